//! Every recipe in configs/ loads and validates (paths are not opened here).

mod common;
use common::repo_path;

#[test]
fn every_recipe_loads() {
    let dir = repo_path("configs");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("json") {
            continue;
        }
        let v = vitscale::config::load_json(Some(&path), &[]).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let cfg = vitscale::config::resolve(&v, 1).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        cfg.model.validate().unwrap();
        n += 1;
    }
    assert!(n >= 4, "found {n} recipes");
}

/// The built-in recipe is exactly the no-argument default.
#[test]
fn builtin_recipe_is_the_default() {
    let path = repo_path("configs/builtin_default.json");
    let from_file = vitscale::config::resolve(&vitscale::config::load_json(Some(&path), &[]).unwrap(), 1).unwrap();
    let default = vitscale::config::resolve(&vitscale::config::load_json(None, &[]).unwrap(), 1).unwrap();
    assert_eq!(from_file, default);
}

/// The fine-tuning recipe is what configs/README.md says it is: ViT-S/16 at 224 px on CIFAR-10
/// (the 32-px images resampled), global batch 512 as micro 256 × GAS 2 on one GPU (× 1 on two),
/// warm-up then cosine, clipping 1.0, label smoothing 0.1.
#[test]
fn the_cifar10_fine_tuning_recipe() {
    use vitscale::config::{DatasetKind, SchedulerConfig};
    let path = repo_path("configs/vit_s16_cifar10_finetune.json");
    let v = vitscale::config::load_json(Some(&path), &[]).unwrap();
    let one = vitscale::config::resolve(&v, 1).unwrap();
    assert_eq!(one.model, vitscale::model::ModelConfig { num_classes: 10, ..vitscale::model::ModelConfig::preset("vit_small_patch16_224").unwrap() });
    assert_eq!(one.data.dataset, DatasetKind::Cifar10);
    assert_eq!((one.batch.train_batch_size, one.batch.micro_batch_per_gpu, one.batch.gradient_accumulation_steps), (512, 256, 2));
    let two = vitscale::config::resolve(&v, 2).unwrap();
    assert_eq!((two.batch.micro_batch_per_gpu, two.batch.gradient_accumulation_steps), (256, 1));
    assert!(matches!(one.scheduler, Some(SchedulerConfig::WarmupCosineLR { warmup_num_steps: 100, .. })), "{:?}", one.scheduler);
    assert_eq!(one.gradient_clipping, 1.0);
    assert_eq!(one.train.label_smoothing, 0.1);
}

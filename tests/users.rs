//! What a user runs into, one class at a time: configurations that round-trip through the run
//! directory, DeepSpeed's rules at the edges (unknown keys, duplicates, the batch triple),
//! sizes that cannot fit, outcomes that would hide a problem (empty splits, reused run
//! directories, resumes that differ), waits with limits, and messages that say what happened
//! once. Each test covers the whole class (every section, every split, every waiting side…),
//! not one quoted case.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use vitscale::config::{self, load_json, resolve, resolved_json, RunConfig};

mod common;
use common::{free_port, last_json, tmp, vitscale_env, EXE};

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}


/// A small, quick CPU run on the built-in data.
const SMALL: &[&str] = &["--device", "cpu", "--set", "data.train_size=256", "--set", "data.val_size=64", "--set", "train.steps=4"];

/// `train` with the small run's settings, then `extra`.
fn small<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec!["train"];
    a.extend_from_slice(SMALL);
    a.extend_from_slice(extra);
    a
}

fn args<'a>(head: &[&'a str], tail: &[&'a str]) -> Vec<&'a str> {
    head.iter().chain(tail).copied().collect()
}

/// A small xorshift generator, seeded fresh per test run (the seed is printed on failure).
struct Rng(u64);
impl Rng {
    fn fresh() -> (Rng, u64) {
        let seed = common::fresh_seed() | 1;
        (Rng(seed), seed)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[(self.next() % xs.len() as u64) as usize]
    }
}

// ---- the run directory re-runs the run ------------------------------------------------------

/// Random configurations across optimizers, schedules, precisions, datasets, model fields and
/// the train section: `resolved_json` (what `config.json` holds) resolves back to the same
/// configuration, for the world size it was written for.
#[test]
fn every_resolved_configuration_round_trips() {
    let (mut rng, seed) = Rng::fresh();
    for i in 0..200 {
        let world = *rng.pick(&[1usize, 2, 4]);
        let micro = *rng.pick(&[8u64, 16, 32]);
        let mut v = json!({
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": *rng.pick(&[1u64, 2, 3]),
            "gradient_clipping": *rng.pick(&[0.0, 0.5, 1.0]),
            "model": {"preset": *rng.pick(&["vit_builtin_default", "vit_tiny_patch4_32"]), "depth": *rng.pick(&[1u64, 2, 3])},
            "data": {"dataset": *rng.pick(&["builtin", "synthetic"]), "train_size": 512, "val_size": 64, "augment": *rng.pick(&["default", "none"])},
            "train": {"seed": rng.next() % 1000, "label_smoothing": *rng.pick(&[0.0, 0.1]), "log_every": *rng.pick(&[1u64, 5]),
                      "checkpoint_every": *rng.pick(&[0u64, 3]), "eval_every": *rng.pick(&[0u64, 2])},
        });
        let opt = match rng.next() % 3 {
            0 => json!({"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1, "betas": [0.9, 0.95]}}),
            1 => json!({"type": "Adam", "params": {"lr": 1e-3, "adam_w_mode": false, "weight_decay": 0.01}}),
            _ => json!({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": true}}),
        };
        v["optimizer"] = opt;
        match rng.next() % 4 {
            0 => v["scheduler"] = json!({"type": "WarmupLR", "params": {"warmup_num_steps": 5}}),
            1 => v["scheduler"] = json!({"type": "WarmupDecayLR", "params": {"total_num_steps": 50, "warmup_num_steps": 5}}),
            2 => v["scheduler"] = json!({"type": "WarmupCosineLR", "params": {"total_num_steps": "auto", "warmup_num_steps": 5}}),
            _ => {}
        }
        match rng.next() % 3 {
            0 => v["bf16"] = json!({"enabled": true}),
            1 => v["fp16"] = json!({"enabled": true, "loss_scale": 0, "initial_scale_power": 12}),
            _ => {}
        }
        if rng.next() % 2 == 0 {
            v["zero_optimization"] = json!({"stage": rng.next() % 3, "reduce_bucket_size": 100_000});
        }
        let a = resolve(&v, world).unwrap_or_else(|e| panic!("seed {seed} case {i}: {e}\n{v}"));
        let written = resolved_json(&a);
        let b = resolve(&written, world).unwrap_or_else(|e| panic!("seed {seed} case {i}: config.json does not load: {e}\n{written}"));
        assert_eq!(RunConfig { warnings: vec![], ..a.clone() }, RunConfig { warnings: vec![], ..b }, "seed {seed} case {i}: {v}");
    }
}

/// `vitscale train --config <run dir>/config.json` runs the same run again, bit for bit.
#[test]
fn a_run_directory_config_reproduces_the_run() {
    let t = tmp();
    let r1 = t.path().join("r1");
    let extra = ["--json", "--run-dir", r1.to_str().unwrap(), "--set", "model.num_heads=2", "--set", "optimizer.params.lr=3e-3"];
    let first = vitscale_env(t.path(), &small(&extra), &[]);
    assert!(first.status.success(), "{}", stderr(&first));
    let cfg = r1.join("config.json");
    let written: Value = serde_json::from_slice(&std::fs::read(&cfg).unwrap()).unwrap();
    assert!(written.get("train_batch_size").is_some() && written.get("plan").is_some(), "{written}");
    let r2 = t.path().join("r2");
    let again = vitscale_env(t.path(), &["train", "--device", "cpu", "--json", "--config", cfg.to_str().unwrap(), "--run-dir", r2.to_str().unwrap()], &[]);
    assert!(again.status.success(), "{}", stderr(&again));
    assert!(!stderr(&again).contains("unknown key"), "{}", stderr(&again));
    assert_eq!(last_json(&first)["weights_hash"], last_json(&again)["weights_hash"]);
}

/// Every weights file a run writes (`--save-weights` and each checkpoint's) evaluates with no
/// config to the run's own validation result: the architecture travels in the file. The model
/// has heads of width 16, which no reading of the shapes can guess.
#[test]
fn every_weights_file_a_run_writes_evaluates_without_a_config() {
    let t = tmp();
    let run = t.path().join("run");
    let w = t.path().join("final.safetensors");
    let out = vitscale_env(
        t.path(),
        &small(&["--json", "--run-dir", run.to_str().unwrap(), "--save-weights", w.to_str().unwrap(), "--set", "train.checkpoint_every=2"]),
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let top1 = last_json(&out)["val_top1"].as_f64().unwrap();
    let files = [w.clone(), run.join("checkpoints/step_000004/model.safetensors"), run.join("checkpoints/step_000002/model.safetensors")];
    for (i, f) in files.iter().enumerate() {
        let inferred = vitscale::model::weights::infer(f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        assert_eq!(inferred.num_heads, Some(4), "{} carries no head count", f.display());
        if i < 2 {
            let ev = vitscale_env(t.path(), &["eval", "--device", "cpu", "--json", "--weights", f.to_str().unwrap(), "--set", "data.train_size=256", "--set", "data.val_size=64"], &[]);
            assert!(ev.status.success(), "{}", stderr(&ev));
            assert_eq!(last_json(&ev)["top1"].as_f64(), Some(top1), "{}", f.display());
        }
    }
}

// ---- DeepSpeed at the edges -----------------------------------------------------------------

/// Top-level keys DeepSpeed does not know are ignored there, so they are warnings here, each
/// naming the key; a typo of a known key suggests it, an unrelated word suggests nothing.
#[test]
fn every_unknown_top_level_key_warns_and_the_config_runs() {
    for (key, hint) in [("foo", None), ("train_batch_sise", Some("train_batch_size")), ("gradient_clipings", Some("gradient_clipping")), ("my_custom_field", None), ("optimiser", Some("optimizer"))] {
        let c = resolve(&json!({ key: 1 }), 1).unwrap_or_else(|e| panic!("{key}: {e}"));
        let w = c.warnings.iter().find(|w| w.contains(key)).unwrap_or_else(|| panic!("no warning for {key}: {:?}", c.warnings));
        match hint {
            Some(h) => assert!(w.contains(&format!("did you mean \"{h}\"")), "{w}"),
            None => assert!(!w.contains("did you mean"), "{w}"),
        }
    }
}

/// A one-letter slip (substitution, transposition, omission) of every known key of every
/// section suggests that key; no key is suggested for words three or more edits away.
#[test]
fn every_key_of_every_section_is_suggested_for_its_typos() {
    let tables: &[&[config::KeyDef]] = &[config::TOP_KEYS, config::MODEL_KEYS, config::DATA_KEYS, config::TRAIN_KEYS, config::ADAM_KEYS, config::SGD_KEYS];
    for table in tables {
        let names: Vec<&str> = table.iter().map(|d| d.name).collect();
        for name in names.iter().filter(|n| n.len() >= 5) {
            let mut chars: Vec<char> = name.chars().collect();
            chars.swap(1, 2);
            let swapped: String = chars.iter().collect();
            if names.contains(&swapped.as_str()) || swapped == *name {
                continue;
            }
            let hint = config::suggest(&swapped, names.iter().copied());
            assert!(hint.contains(&format!("\"{name}\"")) || names.iter().any(|n| hint.contains(&format!("\"{n}\"")) && n != name), "{swapped}: {hint}");
        }
        assert_eq!(config::suggest("zzzzqqqq", names.iter().copied()), "");
        assert_eq!(config::suggest("foo", names.iter().copied()), "");
    }
}

/// Inside every section (ours and DeepSpeed's, which forbid extras) an unknown key is an
/// error naming its dotted path.
#[test]
fn an_unknown_key_in_every_section_is_an_error_naming_it() {
    let cases = [
        (json!({"model": {"bogus_key": 1}}), "model.bogus_key"),
        (json!({"data": {"bogus_key": 1}}), "data.bogus_key"),
        (json!({"train": {"bogus_key": 1}}), "train.bogus_key"),
        (json!({"optimizer": {"type": "AdamW", "bogus_key": 1}}), "optimizer.bogus_key"),
        (json!({"optimizer": {"type": "AdamW", "params": {"bogus_key": 1}}}), "optimizer.params.bogus_key"),
        (json!({"optimizer": {"type": "SGD", "params": {"bogus_key": 1}}}), "optimizer.params.bogus_key"),
        (json!({"scheduler": {"type": "WarmupLR", "bogus_key": 1}}), "scheduler.bogus_key"),
        (json!({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 5, "bogus_key": 1}}}), "scheduler.params.bogus_key"),
        (json!({"fp16": {"enabled": true, "bogus_key": 1}}), "fp16.bogus_key"),
        (json!({"bf16": {"enabled": true, "bogus_key": 1}}), "bf16.bogus_key"),
        (json!({"zero_optimization": {"stage": 1, "bogus_key": 1}}), "zero_optimization.bogus_key"),
    ];
    for (v, key) in cases {
        let e = resolve(&v, 1).err().unwrap_or_else(|| panic!("{v} was accepted")).to_string();
        assert!(e.starts_with(key), "{v}: {e}");
    }
}

/// A key given twice is an error naming its dotted path, at every depth, in files and in
/// `--set` values (serde_json alone would keep the last one silently).
#[test]
fn a_duplicate_key_at_any_depth_is_an_error_naming_it() {
    let t = tmp();
    let texts = [
        (r#"{"train_batch_size": 8, "train_batch_size": 16}"#, "train_batch_size"),
        (r#"{"optimizer": {"type": "AdamW", "params": {"lr": 1, "lr": 2}}}"#, "optimizer.params.lr"),
        (r#"{"model": {"depth": 2}, "model": {"depth": 3}}"#, "model"),
        (r#"{"data": {"mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5], "std": [1, 1, 1]}}"#, "data.std"),
        (r#"{"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_num_steps": 4}}}"#, "scheduler.params.warmup_num_steps"),
    ];
    for (i, (text, key)) in texts.iter().enumerate() {
        let p = t.path().join(format!("c{i}.json"));
        std::fs::write(&p, text).unwrap();
        let e = load_json(Some(&p), &[]).err().unwrap_or_else(|| panic!("{text} was accepted")).to_string();
        assert!(e.contains(&format!("duplicate key `{key}`")) && e.contains(p.to_str().unwrap()), "{e}");
    }
    let e = load_json(None, &[r#"optimizer={"type": "SGD", "type": "AdamW"}"#.to_string()]).unwrap_err().to_string();
    assert!(e.contains("duplicate key `type`"), "{e}");
}

/// Config files are read with DeepSpeed's grammar (Hjson): a DeepSpeed config with a trailing
/// comma, comments, unquoted keys and strings resolves to the same configuration as its strict
/// JSON form; a key given twice is still refused by name; text that is neither is refused with
/// a position.
#[test]
fn config_files_are_read_as_deepspeed_reads_them() {
    let t = tmp();
    let strict = t.path().join("strict.json");
    std::fs::write(&strict, r#"{"train_batch_size": 64, "gradient_accumulation_steps": 2, "fp16": {"enabled": false}, "optimizer": {"type": "AdamW", "params": {"lr": 0.0003, "weight_decay": 0.05}}, "zero_optimization": {"stage": 2}}"#).unwrap();
    // as the study's configs are written: a trailing comma after "enabled": false
    let loose = t.path().join("loose.json");
    // (an unquoted string runs to the end of its line, as in Hjson)
    let text = "{\n  # the study's run\n  \"train_batch_size\": 64,\n  // per rank\n  gradient_accumulation_steps: 2\n  \"fp16\": {\"enabled\": false,},\n  optimizer: {\n    type: AdamW\n    params: {lr: 3e-4, weight_decay: 0.05,}\n  }\n  /* ZeRO */ zero_optimization: {stage: 2},\n}\n";
    std::fs::write(&loose, text).unwrap();
    let a = config::resolve(&load_json(Some(&strict), &[]).expect("strict JSON"), 2).expect("strict config");
    let b = config::resolve(&load_json(Some(&loose), &[]).expect("the Hjson form"), 2).expect("Hjson config");
    assert_eq!(config::resolved_json(&a), config::resolved_json(&b));
    assert_eq!((b.batch.micro_batch_per_gpu, b.zero_stage), (16, 2));
    let dup = t.path().join("dup.json");
    std::fs::write(&dup, "{\n  # twice\n  optimizer: {\n    type: AdamW\n    type: SGD\n  }\n}\n").unwrap();
    let e = load_json(Some(&dup), &[]).unwrap_err().to_string();
    assert!(e.contains("duplicate key `optimizer.type`") && e.contains(dup.to_str().unwrap()), "{e}");
    let bad = t.path().join("bad.json");
    std::fs::write(&bad, "{\"train_batch_size\": 64,\n \"optimizer\": {\"type\": \"AdamW\"\n").unwrap();
    let e = load_json(Some(&bad), &[]).unwrap_err().to_string();
    assert!(e.contains("neither JSON nor Hjson") && e.contains("EOF while parsing an object") && e.contains("(line 3, column 0)"), "{e}");
}

/// Every way the batch triple can fail to divide states the three values and the world size.
#[test]
fn every_batch_triple_error_states_the_triple() {
    let cases = [(Some(64), Some(64), None, 2), (Some(100), Some(16), Some(2), 2), (Some(100), None, Some(3), 1), (Some(6), None, None, 4), (Some(8), Some(16), None, 1), (Some(100), Some(3), None, 1)];
    for (t, m, g, w) in cases {
        let e = config::resolve_batch(t, m, g, w).err().unwrap_or_else(|| panic!("{t:?} {m:?} {g:?} {w} accepted")).to_string();
        for name in ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", &format!("world size {w}")] {
            assert!(e.contains(name), "{t:?} {m:?} {g:?} {w}: {e}");
        }
        assert!(!e.contains("Some("), "{e}");
    }
    // a block without a type adjusts the default optimizer (the `--set optimizer.params.lr` hint)
    let c = resolve(&load_json(None, &["optimizer.params.lr=3e-4".into()]).unwrap(), 1).unwrap();
    assert_eq!(c.optimizer.lr(), 3e-4);
}

// ---- sizes that cannot fit ------------------------------------------------------------------

/// Every size that grows the memory — width, depth, resolution, micro-batch, pass size — is
/// refused before allocating when it cannot fit, with the estimate and the limit; exit 1, never
/// an abort.
#[test]
fn every_size_that_cannot_fit_is_refused_with_the_estimate_and_the_limit() {
    let t = tmp();
    let cases: &[&[&str]] = &[
        &["--set", "model.embed_dim=262144", "--set", "model.num_heads=1"],
        &["--set", "model.depth=100000"],
        &["--set", "model.image_size=16384", "--set", "model.patch_size=4"],
        &["--set", "train_micro_batch_size_per_gpu=100000000", "--set", "train.pass_images=100000000", "--set", "data.train_size=100000000"],
        &["--set", "data.train_size=10000000000"],
    ];
    for (i, extra) in cases.iter().enumerate() {
        let dir = t.path().join(format!("r{i}"));
        let mut a = vec!["train", "--device", "cpu", "--run-dir", dir.to_str().unwrap()];
        a.extend_from_slice(extra);
        let t0 = Instant::now();
        let out = vitscale_env(t.path(), &a, &[]);
        let e = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{extra:?}: {e}");
        assert!(e.contains("estimated") && e.contains("GiB") && e.contains("available RAM"), "{extra:?}: {e}");
        assert!(t0.elapsed() < Duration::from_secs(30), "{extra:?} took {:?}", t0.elapsed());
    }
}

/// Under `ulimit -v` every run ends with status 0 or a message and status 1: the estimate
/// checks against the address-space limit, and an allocation the system refuses anyway exits
/// with a message instead of aborting (134).
#[test]
fn under_ulimit_v_no_run_aborts() {
    let t = tmp();
    for (i, micro) in [64, 4096, 65536].iter().enumerate() {
        let dir = t.path().join(format!("r{i}"));
        let cmd = format!(
            "ulimit -v 1500000; exec '{EXE}' train --device cpu --run-dir '{}' --set train_micro_batch_size_per_gpu={micro} --set train.pass_images={micro} --set data.train_size={} --set data.val_size=64 --set train.steps=1",
            dir.display(),
            micro.max(&256)
        );
        let out = Command::new("sh").arg("-c").arg(&cmd).current_dir(t.path()).stdin(Stdio::null()).output().unwrap();
        let code = out.status.code();
        assert!(matches!(code, Some(0) | Some(1)), "micro {micro}: status {:?}: {}", out.status, stderr(&out));
        if code == Some(1) {
            let e = stderr(&out);
            assert!(e.contains("error:") && (e.contains("ulimit -v") || e.contains("out of memory")), "micro {micro}: {e}");
        }
    }
}

/// `bench --device cpu` defaults to a CPU-sized step (not ViT-B/16 at micro 256) and reports
/// no MFU where it has no ceiling.
#[test]
fn bench_on_the_cpu_defaults_to_a_cpu_sized_step() {
    assert_eq!(vitscale::cmd::bench::default_model_and_micro("cpu"), ("vit_tiny_patch4_32", 32));
    let t = tmp();
    let out = vitscale_env(t.path(), &["bench", "--device", "cpu", "--model", "vit_builtin_default", "--steps", "2", "--warmup", "1"], &[]);
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(s.contains("no MFU") && !s.contains("MFU 0.0"), "{s}");
    let big = vitscale_env(t.path(), &["bench", "--device", "cpu", "--model", "vit_large_patch16_224", "--micro", "100000"], &[]);
    assert_eq!(big.status.code(), Some(1));
    assert!(stderr(&big).contains("estimated"), "{}", stderr(&big));
}

// ---- no silent wrong result -----------------------------------------------------------------

fn write_cifar10(dir: &Path, per_file: &[(&str, usize)]) {
    std::fs::create_dir_all(dir).unwrap();
    for (name, n) in per_file {
        let mut bytes = Vec::with_capacity(n * 3073);
        for i in 0..*n {
            bytes.push((i % 10) as u8);
            bytes.extend(std::iter::repeat_n((i * 7 % 256) as u8, 3072));
        }
        std::fs::write(dir.join(name), bytes).unwrap();
    }
}

/// Every split of every dataset kind that ends up empty stops the run, naming the split.
#[test]
fn every_empty_split_is_refused() {
    let t = tmp();
    // CIFAR: an empty test file, and records nowhere
    let c1 = t.path().join("c1");
    write_cifar10(&c1, &[("data_batch_1.bin", 8), ("test_batch.bin", 0)]);
    let c2 = t.path().join("c2");
    write_cifar10(&c2, &[("data_batch_1.bin", 0), ("test_batch.bin", 4)]);
    // folder: a val split too small to hold an image, and an empty val/ folder
    let f1 = t.path().join("f1");
    for class in ["a", "b"] {
        std::fs::create_dir_all(f1.join(class)).unwrap();
        image::RgbImage::new(8, 8).save(f1.join(class).join("x.png")).unwrap();
    }
    let f2 = t.path().join("f2");
    for class in ["a", "b"] {
        std::fs::create_dir_all(f2.join("train").join(class)).unwrap();
        image::RgbImage::new(8, 8).save(f2.join("train").join(class).join("x.png")).unwrap();
        std::fs::create_dir_all(f2.join("val").join(class)).unwrap();
    }
    let cases: Vec<(Vec<String>, &str)> = vec![
        (vec!["data.dataset=cifar10".into(), format!("data.path={}", c1.display())], "test_batch.bin"),
        (vec!["data.dataset=cifar10".into(), format!("data.path={}", c2.display())], "data_batch_1.bin"),
        (vec!["data.dataset=cifar10".into(), format!("data.path={}", c1.display()), "data.skip_bad=true".into()], "validation split has no images"),
        (vec!["data.dataset=cifar10".into(), format!("data.path={}", c2.display()), "data.skip_bad=true".into()], "training split has no images"),
        (vec!["data.dataset=folder".into(), format!("data.path={}", f1.display()), "data.val_split=0.01".into()], "validation"),
        (vec!["data.dataset=folder".into(), format!("data.path={}", f2.display())], "no folder val files"),
        (vec!["data.val_size=0".into()], "data.val_size"),
        (vec!["data.train_size=0".into()], "data.train_size"),
    ];
    for (i, (sets, needle)) in cases.iter().enumerate() {
        let dir = t.path().join(format!("run{i}"));
        let mut a: Vec<String> = ["train", "--device", "cpu", "--run-dir", dir.to_str().unwrap(), "--set", "train_batch_size=2", "--set", "model.preset=vit_builtin_default"].iter().map(|s| s.to_string()).collect();
        for s in sets {
            a.push("--set".into());
            a.push(s.clone());
        }
        let refs: Vec<&str> = a.iter().map(String::as_str).collect();
        let out = vitscale_env(t.path(), &refs, &[]);
        let e = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{sets:?}: {e}");
        assert!(e.contains(needle), "{sets:?}: {e}");
        assert!(!e.contains("val_top1"), "{sets:?}: {e}");
    }
}

/// A partial copy of CIFAR is trained with a warning naming the missing files; an empty file
/// is an error naming it.
#[test]
fn missing_cifar_files_are_named_and_empty_ones_refused() {
    let t = tmp();
    let d = t.path().join("cifar");
    write_cifar10(&d, &[("data_batch_1.bin", 8), ("data_batch_3.bin", 8), ("test_batch.bin", 4)]);
    let run = t.path().join("r");
    let base = ["train", "--device", "cpu", "--set", "data.dataset=cifar10", "--set", "model.preset=vit_builtin_default", "--set", "model.image_size=32", "--set", "train_batch_size=8", "--set", "train.steps=1"];
    let path = format!("data.path={}", d.display());
    let out = vitscale_env(t.path(), &args(&base, &["--set", &path, "--run-dir", run.to_str().unwrap()]), &[]);
    let e = stderr(&out);
    assert!(out.status.success(), "{e}");
    for missing in ["data_batch_2.bin", "data_batch_4.bin", "data_batch_5.bin"] {
        assert!(e.contains(missing), "{e}");
    }
    std::fs::write(d.join("data_batch_2.bin"), b"").unwrap();
    let out = vitscale_env(t.path(), &args(&base, &["--set", &path, "--run-dir", t.path().join("r2").to_str().unwrap()]), &[]);
    let e = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{e}");
    assert!(e.contains("data_batch_2.bin") && e.contains("empty"), "{e}");
}

/// A directory holding any trace of an earlier run is not written over by a new one; only a
/// resume reopens it.
#[test]
fn a_run_directory_holding_any_run_file_is_refused() {
    let t = tmp();
    for f in vitscale::train::run_dir::RUN_FILES {
        let dir = t.path().join(format!("d-{f}"));
        std::fs::create_dir_all(&dir).unwrap();
        if *f == "checkpoints" {
            std::fs::create_dir(dir.join(f)).unwrap();
        } else {
            std::fs::write(dir.join(f), b"{}").unwrap();
        }
        let out = vitscale_env(t.path(), &small(&["--run-dir", dir.to_str().unwrap()]), &[]);
        let e = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{f}: {e}");
        assert!(e.contains("already holds a run") && e.contains(f), "{f}: {e}");
    }
    // an empty directory is fine
    let empty = t.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let out = vitscale_env(t.path(), &small(&["--run-dir", empty.to_str().unwrap()]), &[]);
    assert!(out.status.success(), "{}", stderr(&out));
}

/// A resume continues a run exactly: a change to any key that shapes the trajectory is refused
/// naming it; the run's length may change.
#[test]
fn a_resume_that_changes_the_trajectory_is_refused_naming_every_key() {
    let t = tmp();
    let first = t.path().join("first");
    let out = vitscale_env(t.path(), &small(&["--run-dir", first.to_str().unwrap(), "--set", "train.checkpoint_every=2"]), &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let ck = first.join("checkpoints/step_000002");
    let changes: &[(&str, &str)] = &[
        ("train.seed=7", "train.seed"),
        ("optimizer.params.lr=0.5", "optimizer.params.lr"),
        ("train.label_smoothing=0.2", "train.label_smoothing"),
        ("gradient_clipping=0.5", "gradient_clipping"),
        ("data.augment=none", "data.augment"),
        ("train_batch_size=128", "train_batch_size"),
    ];
    for (i, (set, key)) in changes.iter().enumerate() {
        let dir = t.path().join(format!("r{i}"));
        let out = vitscale_env(t.path(), &small(&["--run-dir", dir.to_str().unwrap(), "--resume", ck.to_str().unwrap(), "--set", set]), &[]);
        let e = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{set}: {e}");
        assert!(e.contains(key), "{set}: {e}");
    }
    // longer is fine
    let ok = t.path().join("longer");
    let out = vitscale_env(t.path(), &small(&["--run-dir", ok.to_str().unwrap(), "--resume", ck.to_str().unwrap(), "--set", "train.steps=6"]), &[]);
    assert!(out.status.success(), "{}", stderr(&out));
}

/// Resuming on another world size with the run's own config.json (which names all three batch
/// keys) keeps the checkpoint's global batch and says how it was split.
#[test]
fn a_resume_on_another_world_size_keeps_the_global_batch() {
    let t = tmp();
    let first = t.path().join("first");
    let out = vitscale_env(t.path(), &small(&["--run-dir", first.to_str().unwrap(), "--set", "train.checkpoint_every=2", "--set", "train_batch_size=64"]), &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let cfg = first.join("config.json");
    let two = t.path().join("two");
    let port = free_port().to_string();
    let out = vitscale_env(
        t.path(),
        &["launch", "--nproc-per-node", "2", "--master-port", &port, "--", "train", "--device", "cpu", "--json", "--config", cfg.to_str().unwrap(),
          "--resume", first.join("checkpoints/step_000002").to_str().unwrap(), "--run-dir", two.to_str().unwrap()],
        &[],
    );
    let e = stderr(&out);
    assert!(out.status.success(), "{e}");
    assert!(e.contains("train_batch_size 64 kept") && e.contains("× 2 ranks"), "{e}");
    assert_eq!(last_json(&out)["images"].as_u64(), Some(2 * 64), "two steps of 64 after the resume");
}

// ---- waits that say so ----------------------------------------------------------------------

/// Both sides of the rendezvous wait `train.comm_timeout_s`, say whom they wait for, and fail
/// naming the missing side — rank 0 without its peers, and a peer without rank 0.
#[test]
fn every_side_of_the_rendezvous_honours_the_configured_timeout() {
    let t = tmp();
    for rank in ["0", "1"] {
        let port = free_port().to_string();
        let dir = t.path().join(format!("r{rank}"));
        let t0 = Instant::now();
        let out = vitscale_env(
            t.path(),
            &small(&["--run-dir", dir.to_str().unwrap(), "--set", "train.comm_timeout_s=6"]),
            &[("RANK", rank), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", &port)],
        );
        let took = t0.elapsed();
        let e = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "rank {rank}: {e}");
        assert!(took >= Duration::from_secs(5) && took < Duration::from_secs(40), "rank {rank} took {took:?}: {e}");
        assert!(e.contains("waiting for"), "rank {rank} did not say it was waiting: {e}");
        let named = if rank == "0" { e.contains("[1]") } else { e.contains("rank 0") };
        assert!(named, "rank {rank}: {e}");
    }
}

/// A process of another job that reaches a job's rendezvous port is refused with a message
/// naming both jobs, and the job it reached goes on with its own ranks.
#[test]
fn a_rendezvous_refuses_a_rank_of_another_job() {
    use vitscale::comm::rendezvous::{rendezvous, RendezvousRequest};
    let port = free_port();
    let req = move |rank: usize, job: &str| RendezvousRequest {
        rank,
        world_size: 2,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        timeout: Duration::from_secs(20),
        config_hash: "h".into(),
        job_id: job.into(),
        data_port: 1,
        blob: Vec::new(),
    };
    let a0 = std::thread::spawn(move || rendezvous(&req(0, "job-a")).map(|r| r.world_size));
    std::thread::sleep(Duration::from_millis(300));
    let stranger = rendezvous(&req(1, "job-b")).err().expect("a rank of another job was let in").to_string();
    assert!(stranger.contains("job-a") && stranger.contains("job-b") && stranger.contains("same port"), "{stranger}");
    let a1 = rendezvous(&req(1, "job-a")).map(|r| r.world_size);
    assert_eq!(a1.ok(), Some(2));
    assert_eq!(a0.join().unwrap().ok(), Some(2));
    // the identity comes from every launcher's variables
    let vars = |pairs: &'static [(&'static str, &'static str)]| move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string());
    assert_eq!(vitscale::comm::env::job_id_from(vars(&[("VITSCALE_JOB_ID", "x")])), "x");
    assert_eq!(vitscale::comm::env::job_id_from(vars(&[("SLURM_JOB_ID", "12"), ("SLURM_STEP_ID", "3")])), "slurm-12.3");
    assert_eq!(vitscale::comm::env::job_id_from(vars(&[("TORCHELASTIC_RUN_ID", "none")])), "");
    assert_eq!(vitscale::comm::env::job_id_from(vars(&[("PMIX_NAMESPACE", "prterun-1@1")])), "prterun-1@1");
}

/// Two launches given one port at the same moment: one job runs, the other fails with a
/// message about the port (or runs after it); neither joins the other, every try.
#[test]
fn two_launches_on_one_port_never_mix() {
    let t = tmp();
    for attempt in 0..3 {
        let port = free_port().to_string();
        let spawn = |name: &str| {
            let dir = t.path().join(format!("{name}{attempt}"));
            let mut cmd = Command::new(EXE);
            cmd.args(["launch", "--nproc-per-node", "2", "--master-port", &port, "--", "train"])
                .args(SMALL)
                .args(["--set", "train.comm_timeout_s=30", "--json", "--run-dir", dir.to_str().unwrap()])
                .current_dir(t.path())
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            for k in ["RANK", "WORLD_SIZE", "MASTER_PORT", "VITSCALE_RUN_ID", "VITSCALE_JOB_ID"] {
                cmd.env_remove(k);
            }
            cmd.spawn().expect("launch")
        };
        let (a, b) = (spawn("a"), spawn("b"));
        let outs = [a.wait_with_output().unwrap(), b.wait_with_output().unwrap()];
        let ok = outs.iter().filter(|o| o.status.success()).count();
        let both = format!("{}\n----\n{}", stderr(&outs[0]), stderr(&outs[1]));
        // Both may succeed when the second starts after the first ended (a loaded machine);
        // never may both fail, and a failure names the port.
        assert!(ok >= 1, "attempt {attempt}: no launch succeeded:\n{both}");
        for o in outs.iter().filter(|o| !o.status.success()) {
            let e = stderr(o);
            assert!(e.contains("same port") || e.contains("already in use"), "attempt {attempt}: {e}");
        }
        for o in outs.iter().filter(|o| o.status.success()) {
            assert_eq!(last_json(o)["images"].as_u64(), Some(4 * 128), "attempt {attempt}: {both}");
        }
    }
}

/// Every port the launcher can be given is checked at the command line: 0 and out-of-range
/// values are refused there, and so is a 0 in `MASTER_PORT`.
#[test]
fn every_bad_port_is_refused_before_starting() {
    let t = tmp();
    for port in ["0", "65536", "-1", "x"] {
        let flag = format!("--master-port={port}");
        let out = vitscale_env(t.path(), &["launch", "--nproc-per-node", "2", &flag, "--", "train"], &[]);
        assert_eq!(out.status.code(), Some(2), "--master-port {port}: {}", stderr(&out));
        assert!(stderr(&out).contains("--master-port"), "{}", stderr(&out));
    }
    let out = vitscale_env(t.path(), &small(&[]), &[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "0")]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("MASTER_PORT"), "{}", stderr(&out));
}

// ---- messages a user understands ------------------------------------------------------------

/// No error repeats its cause: every file-reading failure names the file and the system's
/// reason exactly once.
#[test]
fn every_file_error_names_its_cause_once() {
    let t = tmp();
    let missing = t.path().join("missing");
    let m = missing.to_str().unwrap();
    let cases: Vec<Vec<String>> = vec![
        vec!["train".into(), "--config".into(), format!("{m}.json")],
        vec!["train".into(), "--device".into(), "cpu".into(), "--init".into(), format!("{m}.safetensors")],
        vec!["eval".into(), "--device".into(), "cpu".into(), "--weights".into(), format!("{m}.safetensors")],
        vec!["train".into(), "--device".into(), "cpu".into(), "--set".into(), "data.dataset=cifar10".into(), "--set".into(), format!("data.path={m}")],
        vec!["train".into(), "--device".into(), "cpu".into(), "--resume".into(), m.into()],
    ];
    for a in cases {
        let refs: Vec<&str> = a.iter().map(String::as_str).collect();
        let out = vitscale_env(t.path(), &refs, &[]);
        let e = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{a:?}: {e}");
        let line = e.lines().find(|l| l.starts_with("error:")).unwrap_or_else(|| panic!("{a:?}: no error line: {e}"));
        assert!(line.contains("missing"), "{a:?}: {line}");
        for phrase in ["No such file or directory", "os error 2", "not a checkpoint"] {
            assert!(line.matches(phrase).count() <= 1, "{a:?} repeats {phrase:?}: {line}");
        }
    }
}

/// Every output path is checked before training: a directory, a folder under a file, a
/// folder that cannot be written — each fails at once naming the flag, before any step.
#[test]
fn every_bad_output_path_fails_before_training() {
    let t = tmp();
    let file = t.path().join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let cases: Vec<(&str, PathBuf)> = vec![
        ("--save-weights", t.path().to_path_buf()),
        ("--save-weights", file.join("w.safetensors")),
        ("--trace", file.join("trace")),
        ("--run-dir", file.clone()),
    ];
    for (i, (flag, path)) in cases.iter().enumerate() {
        let dir = t.path().join(format!("r{i}"));
        let mut a = vec!["train", "--device", "cpu", "--set", "train.steps=1000000", flag, path.to_str().unwrap()];
        if *flag != "--run-dir" {
            a.extend(["--run-dir", dir.to_str().unwrap()]);
        }
        let t0 = Instant::now();
        let out = vitscale_env(t.path(), &a, &[]);
        let e = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{flag} {}: {e}", path.display());
        assert!(t0.elapsed() < Duration::from_secs(20), "{flag}: took {:?}", t0.elapsed());
        assert!(!dir.join("metrics.jsonl").exists(), "{flag}: trained before failing");
        if *flag != "--run-dir" {
            assert!(e.contains(flag), "{flag}: {e}");
        }
    }
}

/// Without a GPU, `--device auto` says so in one short line, from rank 0 only, and the help
/// states the real default.
#[test]
fn the_cpu_fallback_notice_is_one_short_line_from_rank_0() {
    let t = tmp();
    let port = free_port().to_string();
    let out = vitscale_env(
        t.path(),
        &["launch", "--nproc-per-node", "2", "--output", "all", "--master-port", &port, "--", "train", "--set", "data.train_size=128", "--set", "data.val_size=64", "--set", "train.steps=2",
          "--run-dir", t.path().join("r").to_str().unwrap()],
        &[("CUDA_VISIBLE_DEVICES", "")],
    );
    let e = stderr(&out);
    assert!(out.status.success(), "{e}");
    let notices: Vec<&str> = e.lines().filter(|l| l.contains("notice:")).collect();
    assert!(notices.len() <= 1, "{notices:?}");
    assert!(notices.iter().all(|l| l.len() < 260), "{notices:?}");
    let help = vitscale_env(t.path(), &["train", "--help"], &[]);
    let h = String::from_utf8_lossy(&help.stdout);
    assert!(h.contains("[default: auto]"), "{h}");
    let top = vitscale_env(t.path(), &["--help"], &[]);
    assert!(!String::from_utf8_lossy(&top.stdout).contains("defaults: CPU"));
}

//! Not a check: writes the built-in dataset as raw files for inspection and for the
//! learnability experiment in `reference/` (run with
//! `VITSCALE_EXPORT=dir cargo test --test data_export -- --ignored --exact export_builtin`).
//! Each test fails, rather than passing idle, when its folder variable is not set.

use vitscale::config::{DataConfig, DatasetKind};

#[test]
#[ignore = "writes files for inspection: VITSCALE_EXPORT=dir"]
fn export_builtin() {
    let dir = std::env::var("VITSCALE_EXPORT").expect("set VITSCALE_EXPORT to the folder to write");
    let side: usize = std::env::var("VITSCALE_EXPORT_SIDE").ok().and_then(|s| s.parse().ok()).unwrap_or(16);
    let cfg = DataConfig { train_size: 10_000, val_size: 2_000, ..DataConfig::for_dataset(DatasetKind::Builtin, None, [0.5; 3], [0.5; 3]) };
    let d = vitscale::data::open(&cfg, side, 10, 0).expect("open builtin");
    std::fs::create_dir_all(&dir).expect("create export dir");
    for (name, set) in [("train", &d.train), ("val", &d.val)] {
        std::fs::write(format!("{dir}/{name}_images_{side}.u8"), &set.images).expect("write images");
        let labels: Vec<u8> = set.labels.iter().map(|&l| l as u8).collect();
        std::fs::write(format!("{dir}/{name}_labels_{side}.u8"), labels).expect("write labels");
    }
}

/// Writes the built-in dataset as a PNG folder tree (`VITSCALE_EXPORT_FOLDER=dir`), for trying
/// `data.dataset=folder` end to end.
#[test]
#[ignore = "writes files for inspection: VITSCALE_EXPORT_FOLDER=dir"]
fn export_builtin_folder() {
    let dir = std::env::var("VITSCALE_EXPORT_FOLDER").expect("set VITSCALE_EXPORT_FOLDER to the folder to write");
    let set = vitscale::data::builtin::generate(3000, 16, 0, 1);
    for i in 0..set.len() {
        let name = vitscale::data::builtin::CLASS_NAMES[set.labels[i] as usize];
        let p = std::path::Path::new(&dir).join(name).join(format!("{i:05}.png"));
        std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        image::RgbImage::from_raw(16, 16, set.image(i).to_vec()).expect("16x16").save(&p).expect("save png");
    }
}

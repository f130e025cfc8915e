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

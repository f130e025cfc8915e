//! The documentation that is generated from the code stays current: `docs/config.md` is the
//! key reference `config::help_text` prints from the one definition of each key. After
//! changing a key, regenerate it with `VITSCALE_UPDATE_DOCS=1 cargo test --release --test docs`.

mod common;
use common::repo_path;

/// `docs/config.md` as `config::help_text` generates it.
fn config_reference() -> String {
    format!(
        "# Configuration keys\n\n\
         Every key `run.json` accepts, with its type, default and meaning, generated from the key\n\
         tables in `src/config/` (regenerate: `VITSCALE_UPDATE_DOCS=1 cargo test --release --test docs`).\n\
         Sections are DeepSpeed's, plus vitscale's `model`, `data` and `train`. Unknown top-level keys\n\
         are ignored with a warning, as DeepSpeed ignores them; unknown keys inside a section, and a key\n\
         given twice in one object, are errors naming the key.\n\n\
         ```text\n{}```\n",
        vitscale::config::help_text()
    )
}

#[test]
fn the_config_reference_is_generated_from_the_key_tables() {
    let path = repo_path("docs/config.md");
    let want = config_reference();
    if std::env::var_os("VITSCALE_UPDATE_DOCS").is_some() {
        std::fs::write(&path, &want).expect("write docs/config.md");
    }
    let have = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        have == want,
        "docs/config.md is not what the key tables generate; run VITSCALE_UPDATE_DOCS=1 cargo test --release --test docs"
    );
    // Every table's keys are in it, so the README's pointer covers every section.
    for key in ["train_batch_size", "zero_optimization", "reduce_bucket_size", "comm_timeout_s", "skip_bad", "embed_dim", "warmup_num_steps"] {
        assert!(have.contains(key), "docs/config.md lacks {key}");
    }
}

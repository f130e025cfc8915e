//! The CUDA backend's kernel choices: `CudaOptions`, one field per knob, and the one place
//! that reads them from the environment (`CudaOptions::from_env`).
//!
//! Every choice computes the same op; they trade speed (and, for the saved GELU form, one
//! rounding) and exist to compare paths and to step around a kernel. A backend opened with
//! `Cuda::with_options` keeps the choices in atomics (`Knobs`), so the benchmark and the
//! selftest can switch them between calls (`set_attention`, `set_fused_gemm`, …).

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};

use super::Cuda;

/// The environment variable of [`CudaOptions::attention`].
pub const ATTENTION_ENV: &str = "VITSCALE_ATTENTION";
/// The environment variable of [`CudaOptions::fused_gemm`].
pub const FUSED_GEMM_ENV: &str = "VITSCALE_FUSED_GEMM";
/// The environment variable of [`CudaOptions::wgmma_attention`].
pub const WGMMA_ATTENTION_ENV: &str = "VITSCALE_WGMMA_ATTENTION";
/// The environment variable of [`CudaOptions::wide_gemm`].
pub const WIDE_GEMM_ENV: &str = "VITSCALE_WIDE_GEMM";
/// The environment variable of [`CudaOptions::gemm_cluster`].
pub const GEMM_CLUSTER_ENV: &str = "VITSCALE_GEMM_CLUSTER";
/// The environment variable of [`CudaOptions::gemm_ring`].
pub const GEMM_RING_ENV: &str = "VITSCALE_GEMM_RING";
/// The environment variable of [`CudaOptions::wgrad_gemm`].
pub const WGRAD_GEMM_ENV: &str = "VITSCALE_WGRAD_GEMM";
/// The environment variable of [`CudaOptions::fold_keys`].
pub const FOLD_KEYS_ENV: &str = "VITSCALE_FOLD_KEYS";
/// The environment variable of [`CudaOptions::gemm_tune`].
pub const GEMM_TUNE_ENV: &str = "VITSCALE_GEMM_TUNE";

/// How the CUDA backend computes attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionPath {
    /// Materialized probabilities through cuBLASLt batched GEMMs and a softmax kernel.
    Gemm = 0,
    /// Fused tensor-core kernels (the default): for N ≤ 80 small whole-head blocks both ways;
    /// else the pipelined forward, and for N ≤ 256 the backward that keeps a whole head in one
    /// block (the key-block backward beyond).
    Fused = 1,
    /// As `Fused` with the key-block backward (dQ through f32 atomics) for every N.
    FusedPipe = 2,
}

impl AttentionPath {
    pub const ALL: [AttentionPath; 3] = [AttentionPath::Gemm, AttentionPath::Fused, AttentionPath::FusedPipe];
    pub fn name(self) -> &'static str {
        match self {
            AttentionPath::Gemm => "gemm",
            AttentionPath::Fused => "fused",
            AttentionPath::FusedPipe => "fused-pipe",
        }
    }
    fn from_u8(v: u8) -> AttentionPath {
        match v {
            1 => AttentionPath::Fused,
            2 => AttentionPath::FusedPipe,
            _ => AttentionPath::Gemm,
        }
    }
}

/// Parses an attention path name (`gemm`, `fused`, `fused-pipe`; empty = the default, fused).
pub fn parse_attention(v: &str) -> Result<AttentionPath, String> {
    match v {
        "" => Ok(AttentionPath::Fused),
        other => AttentionPath::ALL
            .into_iter()
            .find(|p| p.name() == other)
            .ok_or_else(|| format!("attention path must be gemm, fused or fused-pipe, got {other:?}")),
    }
}

/// Where the Hopper GEMM kernels take 128×256 tiles (the width must be a multiple of 256).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WideTiles {
    /// 128×128 tiles.
    Off = 0,
    /// Where fewer waves of wide tiles are expected to finish first (`hopper_gemm_shape`).
    Auto = 1,
    /// Wherever the width allows (the selftest).
    Always = 2,
}

impl WideTiles {
    fn from_u8(v: u8) -> Self {
        match v {
            0 => WideTiles::Off,
            2 => WideTiles::Always,
            _ => WideTiles::Auto,
        }
    }
}

/// Which ring of TMA stages the Hopper GEMM kernels with 128×256 tiles take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmRing {
    /// The 4-stage ring where the product's depth K (the model's width) is at least
    /// `DEEP_RING_MIN_K`, else the 3-stage one: the deeper ring hides more of each K step's
    /// copy, and pays for it with an epilogue that drains one staging half at a time, which
    /// (most likely) costs more than it saves when a tile has few K steps.
    Auto = 0,
    /// The 3-stage ring and two staging halves.
    Three = 1,
    /// The 4-stage ring and one staging half.
    Four = 2,
}

/// The smallest K at which `GemmRing::Auto` takes the 4-stage ring (ViT-L's width; at ViT-B's
/// 768 and ViT-S's 384 the 3-stage ring ran faster, BENCHMARKS.md).
pub const DEEP_RING_MIN_K: usize = 1024;

impl GemmRing {
    pub const ALL: [GemmRing; 3] = [GemmRing::Auto, GemmRing::Three, GemmRing::Four];

    /// Its `VITSCALE_GEMM_RING` value.
    pub fn name(self) -> &'static str {
        match self {
            GemmRing::Auto => "auto",
            GemmRing::Three => "3",
            GemmRing::Four => "4",
        }
    }

    fn from_u8(v: u8) -> Self {
        match v {
            1 => GemmRing::Three,
            2 => GemmRing::Four,
            _ => GemmRing::Auto,
        }
    }

    /// Whether a product of depth `k` takes the 4-stage ring.
    pub fn deep_at(self, k: usize) -> bool {
        match self {
            GemmRing::Auto => k >= DEEP_RING_MIN_K,
            GemmRing::Three => false,
            GemmRing::Four => true,
        }
    }
}

/// How the GEMM tuner picks each product's cuBLASLt algorithm on first use (`gemm`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmTune {
    /// Interleaved rounds over the heuristic's candidates, then, for products of 0.15 ms or
    /// more, each close candidate alone over a sustained stretch (the clock under the power cap
    /// follows the power a kernel draws).
    Sustained,
    /// The interleaved rounds only.
    Quick,
}

/// The CUDA backend's kernel choices. `Default` is what a run gets with none of the variables
/// set; `from_env` reads them. Values are matched after trimming whitespace, and an empty value
/// means the default.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaOptions {
    /// The attention path (`set_attention` changes it later). `VITSCALE_ATTENTION`:
    /// `fused` (the default) — flash-attention kernels (`kernels/flash.cu`, head dims 32, 64,
    /// 80, 96, 128; other head dims take the gemm path) keeping only the log-sum-exp per row, with
    /// whole-head blocks where the sequence is short (parity, and a 1.24× step at ViT-B/16
    /// micro 256 against `gemm`; BENCHMARKS.md); `fused-pipe` — the tiled forward and the
    /// key-block backward for every N (what N > 256 gets anyway; for comparison); `gemm` —
    /// materialized probabilities through cuBLASLt batched GEMMs and a softmax kernel.
    pub attention: AttentionPath,
    /// Whether the Hopper GEMM kernels (`kernels/hopper.cu`, sm_90 only) run where they apply:
    /// (fc1's forward with its GELU, fc2's input gradient with the GELU backward and fc1's bias
    /// sums); elsewhere cuBLASLt and the separate passes (`set_fused_gemm` changes it later).
    /// `VITSCALE_FUSED_GEMM`: `on` (the default; also `1` or `all`) — both (each ≈ 1 % off a
    /// CIFAR ViT-S step against cuBLASLt and the separate pass; the second ≈ 0.4 % at ViT-B/16;
    /// BENCHMARKS.md); `fwd` — the forward kernel only; `0` or `off` — neither.
    pub fused_gemm: (bool, bool),
    /// Whether the wgmma attention kernels (`flash_{fwd,bwd}_wg_d64` in hopper.cu: ViT-B/16's
    /// 197 tokens on sm_90) run where they apply; else flash.cu's mma.sync kernels
    /// (`set_wgmma_attention` changes it later). `VITSCALE_WGMMA_ATTENTION`: `on` (the default;
    /// also `1`); `0` or `off`.
    pub wgmma_attention: bool,
    /// Where the Hopper GEMM kernels take 128×256 tiles (the `_w` kernels, where the output
    /// width is a multiple of 256): (fc1's forward, fc2's input gradient) (`set_wide_gemm`
    /// changes it later). `VITSCALE_WIDE_GEMM`: `auto` (the default) — both, where the tile
    /// count favours them (`WideTiles::Auto`; ViT-B/16 micro 256 ≈ 1.5 % faster per step than
    /// with 128×128 tiles, CIFAR ViT-S ≈ 0.5 %; BENCHMARKS.md); `fwd` — the forward only;
    /// `always` — both, wherever the width allows; `0` or `off` — 128×128 tiles everywhere.
    pub wide_gemm: (WideTiles, WideTiles),
    /// Whether the 128×256-tile Hopper GEMM kernels run in clusters of two blocks that share
    /// their B tile through multicast copies (`set_gemm_cluster` changes it later; it falls
    /// back to single blocks where the device cannot hold a cluster a block's size; on an H100
    /// they ran at the speed of single blocks, BENCHMARKS.md).
    /// `VITSCALE_GEMM_CLUSTER`: `0` or `off` (the default); `on` or `1`.
    pub gemm_cluster: bool,
    /// Where the Hopper GEMM kernels with 128×256 tiles (fc1's forward, fc2's input gradient)
    /// take the forms with a 4-stage ring and one staging half (the `_w4` kernels, RING4 in
    /// hopper.cu) instead of a 3-stage ring and two staging halves (`set_gemm_ring` changes it
    /// later). `VITSCALE_GEMM_RING`: `auto` (the default), `3` or `4`.
    pub gemm_ring: GemmRing,
    /// Whether the weight gradients (and the bias gradients beside them) take the Hopper
    /// kernel `gemm_wgrad_tt` (`kernels/hopper_wgrad.cu`: K split into chunks so that few
    /// output tiles still fill the GPU) where it applies (sm_90, both widths multiples of 64);
    /// else cuBLASLt (`set_wgrad_gemm` changes it later). `VITSCALE_WGRAD_GEMM`: `0` or `off`
    /// (the default: on an H200 it took longer than cuBLASLt and the column-sum passes in
    /// three of four shapes, BENCHMARKS.md); `on` or `1`.
    pub wgrad_gemm: bool,
    /// Whether the key-block attention backward on wgmma leaves N mod 128 = 1 or 2 first keys
    /// (a class token, over a patch grid that tiles by 128) to the delta pass
    /// (`flash_bwd_pre_fold` in flash.cu) instead of a block of their own (`set_fold_keys`
    /// changes it later). `VITSCALE_FOLD_KEYS`: `on` (the default; also `1`); `0` or `off`.
    pub fold_keys: bool,
    /// How the GEMM tuner times cuBLASLt's candidates on first use; fixed when the backend
    /// opens, and part of the key of the choices kept on disk. `VITSCALE_GEMM_TUNE`:
    /// `sustained` (the default) or `quick` (`GemmTune`).
    pub gemm_tune: GemmTune,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            attention: AttentionPath::Fused,
            fused_gemm: (true, true),
            wgmma_attention: true,
            wide_gemm: (WideTiles::Auto, WideTiles::Auto),
            gemm_cluster: false,
            gemm_ring: GemmRing::Auto,
            wgrad_gemm: false,
            fold_keys: true,
            gemm_tune: GemmTune::Sustained,
        }
    }
}

impl CudaOptions {
    /// The options the `VITSCALE_*` variables above choose; a variable that is unset (or not
    /// valid Unicode) keeps the default. A value outside a variable's list is an error naming
    /// the variable and its accepted values.
    pub fn from_env() -> Result<CudaOptions, String> {
        Self::from_vars(env)
    }

    /// `from_env` with the variables looked up by `get` (`None`: unset).
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<CudaOptions, String> {
        let attention: Vec<(&str, AttentionPath)> = AttentionPath::ALL.iter().map(|&p| (p.name(), p)).collect();
        Ok(CudaOptions {
            attention: choose(&get, ATTENTION_ENV, AttentionPath::Fused, &attention)?,
            fused_gemm: choose(&get, FUSED_GEMM_ENV, (true, true), &[("on", (true, true)), ("1", (true, true)), ("all", (true, true)), ("fwd", (true, false)), ("0", (false, false)), ("off", (false, false))])?,
            wgmma_attention: choose(&get, WGMMA_ATTENTION_ENV, true, &ON_OFF)?,
            wide_gemm: choose(&get, WIDE_GEMM_ENV, (WideTiles::Auto, WideTiles::Auto), &[
                ("auto", (WideTiles::Auto, WideTiles::Auto)),
                ("fwd", (WideTiles::Auto, WideTiles::Off)),
                ("always", (WideTiles::Always, WideTiles::Always)),
                ("0", (WideTiles::Off, WideTiles::Off)),
                ("off", (WideTiles::Off, WideTiles::Off)),
            ])?,
            gemm_cluster: choose(&get, GEMM_CLUSTER_ENV, false, &ON_OFF)?,
            gemm_ring: choose(&get, GEMM_RING_ENV, GemmRing::Auto, &GemmRing::ALL.map(|r| (r.name(), r)))?,
            wgrad_gemm: choose(&get, WGRAD_GEMM_ENV, false, &ON_OFF)?,
            fold_keys: choose(&get, FOLD_KEYS_ENV, true, &ON_OFF)?,
            gemm_tune: choose(&get, GEMM_TUNE_ENV, GemmTune::Sustained, &[("sustained", GemmTune::Sustained), ("quick", GemmTune::Quick)])?,
        })
    }
}

/// The values of a variable that switches something on or off, as `choose` takes them.
pub(super) const ON_OFF: [(&str, bool); 4] = [("on", true), ("1", true), ("0", false), ("off", false)];

/// The process environment's value of `name` (`None`: unset or not valid Unicode), as
/// `choose` looks variables up.
pub(super) fn env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// The value of variable `name` (looked up by `get`, trimmed) among `accepted`; `default` when
/// it is unset or empty.
pub(super) fn choose<T: Copy>(get: &impl Fn(&str) -> Option<String>, name: &str, default: T, accepted: &[(&str, T)]) -> Result<T, String> {
    let Some(raw) = get(name) else { return Ok(default) };
    let v = raw.trim();
    if v.is_empty() {
        return Ok(default);
    }
    accepted.iter().find(|(k, _)| *k == v).map(|&(_, t)| t).ok_or_else(|| {
        let names: Vec<&str> = accepted.iter().map(|(k, _)| *k).collect();
        let (last, rest) = names.split_last().map_or(("", &[][..]), |(l, r)| (*l, r));
        format!("{name}={raw:?}: expected {} or {last}", rest.join(", "))
    })
}

/// The choices of `CudaOptions` that the backend reads at each call, in atomics so that they
/// can change between calls on a shared `&Cuda`.
pub(super) struct Knobs {
    /// `AttentionPath as u8`.
    attention: AtomicU8,
    pub(super) fused_gemm: AtomicBool,
    pub(super) fused_gemm_bwd: AtomicBool,
    wgmma_attention: AtomicBool,
    /// `WideTiles as u8`, fc1's forward and fc2's input gradient.
    wide_gemm: AtomicU8,
    wide_gemm_bwd: AtomicU8,
    pub(super) gemm_cluster: AtomicBool,
    gemm_ring: AtomicU8,
    pub(super) wgrad_gemm: AtomicBool,
    pub(super) fold_keys: AtomicBool,
}

impl Knobs {
    pub(super) fn new(o: &CudaOptions) -> Knobs {
        Knobs {
            attention: AtomicU8::new(o.attention as u8),
            fused_gemm: AtomicBool::new(o.fused_gemm.0),
            fused_gemm_bwd: AtomicBool::new(o.fused_gemm.1),
            wgmma_attention: AtomicBool::new(o.wgmma_attention),
            wide_gemm: AtomicU8::new(o.wide_gemm.0 as u8),
            wide_gemm_bwd: AtomicU8::new(o.wide_gemm.1 as u8),
            gemm_cluster: AtomicBool::new(o.gemm_cluster),
            gemm_ring: AtomicU8::new(o.gemm_ring as u8),
            fold_keys: AtomicBool::new(o.fold_keys),
            wgrad_gemm: AtomicBool::new(o.wgrad_gemm),
        }
    }

    /// The ring the wide Hopper GEMM kernels take (`set_gemm_ring`).
    pub(super) fn gemm_ring(&self) -> GemmRing {
        GemmRing::from_u8(self.gemm_ring.load(Ordering::Relaxed))
    }

    /// Where fc1's forward (`bwd` false) or fc2's input gradient (`bwd` true) takes wide tiles.
    pub(super) fn wide_tiles(&self, bwd: bool) -> WideTiles {
        WideTiles::from_u8(if bwd { &self.wide_gemm_bwd } else { &self.wide_gemm }.load(Ordering::Relaxed))
    }
}

impl Cuda {
    /// Whether the Hopper GEMM kernels are chosen (`set_fused_gemm`): (fc1 forward, fc2 input
    /// gradient).
    pub fn fused_gemm(&self) -> (bool, bool) {
        (self.knobs.fused_gemm.load(Ordering::Relaxed), self.knobs.fused_gemm_bwd.load(Ordering::Relaxed))
    }

    /// Uses the Hopper GEMM kernels where they apply — fc1's forward (`fwd`; the default), fc2's
    /// input gradient (`bwd`) — or cuBLASLt plus the separate GELU passes
    /// (`CudaOptions::fused_gemm`).
    pub fn set_fused_gemm(&self, fwd: bool, bwd: bool) {
        self.knobs.fused_gemm.store(fwd, Ordering::Relaxed);
        self.knobs.fused_gemm_bwd.store(bwd, Ordering::Relaxed);
    }

    /// Where the Hopper GEMM kernels take 128×256 tiles (`set_wide_gemm`): (fc1 forward, fc2
    /// input gradient).
    pub fn wide_gemm(&self) -> (WideTiles, WideTiles) {
        (self.knobs.wide_tiles(false), self.knobs.wide_tiles(true))
    }

    /// Where the Hopper GEMM kernels take 128×256 tiles: in fc1's forward (`fwd`) and fc2's
    /// input gradient (`bwd`); `WideTiles::Auto` for both by default (`CudaOptions::wide_gemm`).
    pub fn set_wide_gemm(&self, fwd: WideTiles, bwd: WideTiles) {
        self.knobs.wide_gemm.store(fwd as u8, Ordering::Relaxed);
        self.knobs.wide_gemm_bwd.store(bwd as u8, Ordering::Relaxed);
    }

    /// Whether the 128×256-tile Hopper GEMM kernels run in clusters of two (`set_gemm_cluster`).
    pub fn gemm_cluster(&self) -> bool {
        self.knobs.gemm_cluster.load(Ordering::Relaxed)
    }

    /// Runs the 128×256-tile Hopper GEMM kernels in clusters of two blocks sharing their B
    /// tile (`on`, the default) or as single blocks (`CudaOptions::gemm_cluster`).
    pub fn set_gemm_cluster(&self, on: bool) {
        self.knobs.gemm_cluster.store(on, Ordering::Relaxed);
    }

    /// Which ring the 128×256-tile Hopper GEMM kernels take (`set_gemm_ring`).
    pub fn gemm_ring(&self) -> GemmRing {
        self.knobs.gemm_ring()
    }

    /// Runs the 128×256-tile Hopper GEMM kernels with the 4-stage ring and one staging half,
    /// the 3-stage ring and two, or each by its depth (`GemmRing`; `CudaOptions::gemm_ring`).
    pub fn set_gemm_ring(&self, ring: GemmRing) {
        self.knobs.gemm_ring.store(ring as u8, Ordering::Relaxed);
    }

    /// Whether the weight gradients take the Hopper kernel where it applies (`set_wgrad_gemm`).
    pub fn wgrad_gemm(&self) -> bool {
        self.knobs.wgrad_gemm.load(Ordering::Relaxed)
    }

    /// Computes the weight gradients with `gemm_wgrad_tt` where it applies (`on`) or with
    /// cuBLASLt everywhere (`off`, the default; `CudaOptions::wgrad_gemm`).
    pub fn set_wgrad_gemm(&self, on: bool) {
        self.knobs.wgrad_gemm.store(on, Ordering::Relaxed);
    }

    /// Chooses the attention path for later calls. Buffers sized by `attention_saved_len`
    /// under the gemm path are large enough for the fused paths, not the other way round.
    pub fn set_attention(&self, path: AttentionPath) {
        self.knobs.attention.store(path as u8, Ordering::Relaxed);
    }

    /// The attention path calls take: the chosen one, or gemm where `kernels/flash.cu` did not
    /// load (an architecture without its instructions, e.g. sm_75). Head dims the fused kernels
    /// lack still take the gemm path.
    pub fn attention_path(&self) -> AttentionPath {
        if self.has_flash_attention() {
            self.chosen_attention_path()
        } else {
            AttentionPath::Gemm
        }
    }

    /// The attention path chosen by `set_attention` or `VITSCALE_ATTENTION`, whether or not its
    /// kernels loaded.
    pub fn chosen_attention_path(&self) -> AttentionPath {
        AttentionPath::from_u8(self.knobs.attention.load(Ordering::Relaxed))
    }

    /// Whether the fused attention kernels (`kernels/flash.cu`, an optional module) loaded.
    pub fn has_flash_attention(&self) -> bool {
        self.kernels.get("flash_fwd_d64_pipe").is_ok()
    }

    /// Whether the wgmma attention kernels are chosen where they apply
    /// (`CudaOptions::wgmma_attention`).
    pub fn wgmma_attention(&self) -> bool {
        self.knobs.wgmma_attention.load(Ordering::Relaxed)
    }

    /// Chooses the wgmma attention kernels (where compiled and the shape fits) or flash.cu's.
    pub fn set_wgmma_attention(&self, on: bool) {
        self.knobs.wgmma_attention.store(on, Ordering::Relaxed);
    }

    /// Whether the delta pass takes the wgmma key-block backward's ragged first keys where
    /// there are 1 or 2 of them (`CudaOptions::fold_keys`).
    pub fn fold_keys(&self) -> bool {
        self.knobs.fold_keys.load(Ordering::Relaxed)
    }

    /// Folds those keys into the delta pass, or gives them a key block of their own.
    pub fn set_fold_keys(&self, on: bool) {
        self.knobs.fold_keys.store(on, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let pairs: Vec<(String, String)> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |name| pairs.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
    }

    #[test]
    fn nothing_set_is_the_default() {
        assert_eq!(CudaOptions::from_vars(|_| None), Ok(CudaOptions::default()));
        let empty = [ATTENTION_ENV, FUSED_GEMM_ENV, WGMMA_ATTENTION_ENV, WIDE_GEMM_ENV, GEMM_RING_ENV, WGRAD_GEMM_ENV, FOLD_KEYS_ENV, GEMM_TUNE_ENV].map(|n| (n, " "));
        assert_eq!(CudaOptions::from_vars(vars(&empty)), Ok(CudaOptions::default()));
    }

    #[test]
    fn each_variable_sets_its_field() {
        let o = |pairs: &[(&str, &str)]| CudaOptions::from_vars(vars(pairs)).unwrap();
        for p in AttentionPath::ALL {
            assert_eq!(o(&[(ATTENTION_ENV, p.name())]).attention, p);
        }
        assert_eq!(o(&[(ATTENTION_ENV, " gemm\n")]).attention, AttentionPath::Gemm);
        for (v, want) in [("on", (true, true)), ("1", (true, true)), ("all", (true, true)), ("fwd", (true, false)), ("0", (false, false)), ("off", (false, false))] {
            assert_eq!(o(&[(FUSED_GEMM_ENV, v)]).fused_gemm, want, "{v}");
        }
        for (v, want) in [("on", true), ("1", true), ("0", false), ("off", false)] {
            assert_eq!(o(&[(WGMMA_ATTENTION_ENV, v)]).wgmma_attention, want, "{v}");
        }
        use WideTiles::*;
        for (v, want) in [("auto", (Auto, Auto)), ("fwd", (Auto, Off)), ("always", (Always, Always)), ("0", (Off, Off)), ("off", (Off, Off))] {
            assert_eq!(o(&[(WIDE_GEMM_ENV, v)]).wide_gemm, want, "{v}");
        }
        for (v, want) in [("on", true), ("1", true), ("0", false), ("off", false)] {
            assert_eq!(o(&[(GEMM_CLUSTER_ENV, v)]).gemm_cluster, want, "{v}");
            assert_eq!(o(&[(WGRAD_GEMM_ENV, v)]).wgrad_gemm, want, "{v}");
            assert_eq!(o(&[(FOLD_KEYS_ENV, v)]).fold_keys, want, "{v}");
        }
        for (v, want) in [("auto", GemmRing::Auto), ("3", GemmRing::Three), ("4", GemmRing::Four)] {
            assert_eq!(o(&[(GEMM_RING_ENV, v)]).gemm_ring, want, "{v}");
        }
        assert_eq!(o(&[(GEMM_TUNE_ENV, "quick")]).gemm_tune, GemmTune::Quick);
        assert_eq!(o(&[(GEMM_TUNE_ENV, "sustained")]).gemm_tune, GemmTune::Sustained);
        // one variable leaves the others at their defaults
        let only = o(&[(FUSED_GEMM_ENV, "fwd")]);
        assert_eq!(CudaOptions { fused_gemm: (true, true), ..only }, CudaOptions::default());
    }

    #[test]
    fn a_bad_value_names_the_variable_and_the_accepted_values() {
        let err = |name: &str, v: &str| CudaOptions::from_vars(vars(&[(name, v)])).unwrap_err();
        assert_eq!(err(ATTENTION_ENV, "flash"), "VITSCALE_ATTENTION=\"flash\": expected gemm, fused or fused-pipe");
        assert_eq!(err(FUSED_GEMM_ENV, "yes"), "VITSCALE_FUSED_GEMM=\"yes\": expected on, 1, all, fwd, 0 or off");
        assert_eq!(err(WGMMA_ATTENTION_ENV, "true"), "VITSCALE_WGMMA_ATTENTION=\"true\": expected on, 1, 0 or off");
        assert_eq!(err(WIDE_GEMM_ENV, "wide"), "VITSCALE_WIDE_GEMM=\"wide\": expected auto, fwd, always, 0 or off");
        assert_eq!(err(GEMM_CLUSTER_ENV, "2"), "VITSCALE_GEMM_CLUSTER=\"2\": expected on, 1, 0 or off");
        assert_eq!(err(WGRAD_GEMM_ENV, "yes"), "VITSCALE_WGRAD_GEMM=\"yes\": expected on, 1, 0 or off");
        assert_eq!(err(GEMM_RING_ENV, "5"), "VITSCALE_GEMM_RING=\"5\": expected auto, 3 or 4");
        assert_eq!(err(FOLD_KEYS_ENV, "yes"), "VITSCALE_FOLD_KEYS=\"yes\": expected on, 1, 0 or off");
        assert_eq!(err(GEMM_TUNE_ENV, "slow"), "VITSCALE_GEMM_TUNE=\"slow\": expected sustained or quick");
        // matching is exact after trimming
        assert!(CudaOptions::from_vars(vars(&[(ATTENTION_ENV, "Fused")])).is_err());
    }

    #[test]
    fn auto_ring_goes_deep_from_vit_large_width_on() {
        for (k, deep) in [(384, false), (768, false), (1023, false), (1024, true), (1280, true)] {
            assert_eq!(GemmRing::Auto.deep_at(k), deep, "K {k}");
            assert!(GemmRing::Four.deep_at(k));
            assert!(!GemmRing::Three.deep_at(k));
        }
    }

    #[test]
    fn knobs_start_from_the_options() {
        let o = CudaOptions { attention: AttentionPath::FusedPipe, fused_gemm: (true, false), wgmma_attention: false, wide_gemm: (WideTiles::Always, WideTiles::Off), gemm_cluster: true, gemm_ring: GemmRing::Three, wgrad_gemm: true, fold_keys: false, gemm_tune: GemmTune::Quick };
        let k = Knobs::new(&o);
        assert_eq!(AttentionPath::from_u8(k.attention.load(Ordering::Relaxed)), AttentionPath::FusedPipe);
        assert_eq!((k.fused_gemm.load(Ordering::Relaxed), k.fused_gemm_bwd.load(Ordering::Relaxed)), (true, false));
        assert!(!k.wgmma_attention.load(Ordering::Relaxed));
        assert_eq!((k.wide_tiles(false), k.wide_tiles(true)), (WideTiles::Always, WideTiles::Off));
        assert!(k.gemm_cluster.load(Ordering::Relaxed));
        assert_eq!(k.gemm_ring(), GemmRing::Three);
        assert!(k.wgrad_gemm.load(Ordering::Relaxed));
        assert!(!k.fold_keys.load(Ordering::Relaxed));
    }
}

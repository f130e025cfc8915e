//! Partial JPEG decode for the CPU path (`data.decode_scale = "auto"`): libjpeg-turbo, built
//! from source and linked statically (`turbojpeg-sys`), decodes only the rows and columns of a
//! JPEG that resampling its crop window reads, and at a reduced DCT scale (1/2, 1/4 or 1/8, as
//! libjpeg's `scale_num / scale_denom` and PIL's draft mode) when the window is large enough.
//!
//! The reduction 1/r is the largest with the window still at least the output size both ways
//! at 1/r ([`reduction`]), so resampling only ever shrinks, as it would from the full decode:
//! the scaled DCT (an 8/r-point IDCT of each block's low frequencies) stands in for the first
//! part of the downscale, and the antialiased filter does the rest over a narrower support.
//! The decoded rectangle is the window plus the filter's reach on each side (clamped to the
//! image), its left edge moved down to a multiple of the scaled iMCU width, which libjpeg-turbo
//! needs to start a row mid-image; rows above it are skipped (entropy-decoded only) and rows
//! below it never read. Resampling that rectangle reads exactly the pixels a decode of the
//! whole image at the same scale would give it.

#[cfg(feature = "turbojpeg")]
use std::cell::RefCell;

#[cfg(feature = "turbojpeg")]
use turbojpeg_sys as tj;

use super::resize::Region;

/// Whether this binary has the partial decode (the `turbojpeg` cargo feature, which builds
/// libjpeg-turbo from source: cmake and nasm at build time). Without it `"auto"` decodes whole.
pub const AVAILABLE: bool = cfg!(feature = "turbojpeg");

#[cfg(not(feature = "turbojpeg"))]
const UNAVAILABLE: &str = "partial JPEG decode: vitscale was built without the turbojpeg feature";

/// The largest DCT reduction r ∈ {1, 2, 4, 8} at which `region` (source pixels) still spans at
/// least `side` pixels in both directions.
pub fn reduction(region: Region, side: usize) -> usize {
    let short = region.w.min(region.h) as f64;
    let mut r = 8;
    while r > 1 && short < (r * side) as f64 {
        r /= 2;
    }
    r
}

/// What [`decode`] produced: `width` × `height` RGB pixels at the start of the buffer, the
/// window in their coordinates, and where they come from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Partial {
    pub width: usize,
    pub height: usize,
    /// The crop window (as [`decode`]'s caller drew it on the full-size image) in the decoded
    /// buffer's pixels.
    pub region: Region,
    /// The full-size image's width and height.
    pub source: (usize, usize),
    /// The DCT reduction: the buffer is the image at 1/`reduction`.
    pub reduction: usize,
}

/// A libjpeg-turbo decompressor, one per thread.
#[cfg(feature = "turbojpeg")]
struct Handle(tj::tjhandle);

#[cfg(feature = "turbojpeg")]
impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: the handle came from tj3Init and is destroyed once.
        unsafe { tj::tj3Destroy(self.0) }
    }
}

#[cfg(feature = "turbojpeg")]
thread_local! {
    static HANDLE: RefCell<Option<Handle>> = const { RefCell::new(None) };
}

/// libjpeg-turbo's message for the last error on `h`.
#[cfg(feature = "turbojpeg")]
fn message(h: tj::tjhandle) -> String {
    // SAFETY: tj3GetErrorStr returns a NUL-terminated string owned by the handle.
    let s = unsafe { std::ffi::CStr::from_ptr(tj::tj3GetErrorStr(h)) };
    format!("JPEG (libjpeg-turbo): {}", s.to_string_lossy())
}

/// The width of an iMCU (the horizontal unit libjpeg-turbo can start a cropped row at) of
/// TurboJPEG subsampling `subsamp`, in full-size pixels; None when unknown.
#[cfg(feature = "turbojpeg")]
fn mcu_width(subsamp: i32) -> Option<usize> {
    match subsamp {
        tj::TJSAMP_TJSAMP_444 | tj::TJSAMP_TJSAMP_GRAY | tj::TJSAMP_TJSAMP_440 | tj::TJSAMP_TJSAMP_441 => Some(8),
        tj::TJSAMP_TJSAMP_422 | tj::TJSAMP_TJSAMP_420 => Some(16),
        tj::TJSAMP_TJSAMP_411 => Some(32),
        _ => None,
    }
}

/// Decodes the JPEG `bytes` to RGB8 at the start of `pixels` (grown as needed, never shrunk).
/// `want(width, height)` is asked once the header gives the full size: `None` decodes the whole
/// image at full size; `Some((window, side))` decodes what resampling `window` (full-size
/// pixels) to `side` × `side` reads, at [`reduction`]`(window, side)`.
///
/// Any error *or warning* of libjpeg-turbo (a truncated file, stray bytes between markers) is
/// returned as an error, so the caller can fall back to its full decoder, whose handling of
/// damaged files is the reference.
#[cfg(feature = "turbojpeg")]
pub fn decode(bytes: &[u8], want: impl FnOnce(usize, usize) -> Option<(Region, usize)>, pixels: &mut Vec<u8>) -> Result<Partial, String> {
    HANDLE.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.is_none() {
            // SAFETY: plain constructor; a null handle is checked.
            let h = unsafe { tj::tj3Init(tj::TJINIT_TJINIT_DECOMPRESS as i32) };
            if h.is_null() {
                return Err("JPEG (libjpeg-turbo): cannot create a decompressor".to_string());
            }
            *slot = Some(Handle(h));
        }
        let h = slot.as_ref().map(|h| h.0).unwrap_or(std::ptr::null_mut());
        // SAFETY: `h` is this thread's live decompressor; `bytes` outlives the calls and the
        // destination is checked to hold the pitch × rows it is told.
        unsafe { decode_with(h, bytes, want, pixels) }
    })
}

/// Built without the `turbojpeg` feature: no partial decode, so the caller decodes whole.
#[cfg(not(feature = "turbojpeg"))]
pub fn decode(_bytes: &[u8], _want: impl FnOnce(usize, usize) -> Option<(Region, usize)>, _pixels: &mut Vec<u8>) -> Result<Partial, String> {
    Err(UNAVAILABLE.to_string())
}

/// The whole JPEG `bytes` at 1/`r` (r ∈ {1, 2, 4, 8}) into `pixels`, as [`decode`].
pub fn decode_whole(bytes: &[u8], r: usize, pixels: &mut Vec<u8>) -> Result<Partial, String> {
    // A window of the whole image with an output of its shorter side / r: reduction r exactly,
    // and no crop.
    decode(bytes, |w, h| Some((Region { x0: 0.0, y0: 0.0, w: w as f32, h: h as f32 }, (w.min(h) / r).max(1))), pixels)
}

#[cfg(feature = "turbojpeg")]
unsafe fn decode_with(h: tj::tjhandle, bytes: &[u8], want: impl FnOnce(usize, usize) -> Option<(Region, usize)>, pixels: &mut Vec<u8>) -> Result<Partial, String> {
    if tj::tj3DecompressHeader(h, bytes.as_ptr(), bytes.len() as _) != 0 {
        return Err(message(h));
    }
    let (w, hh) = (tj::tj3Get(h, tj::TJPARAM_TJPARAM_JPEGWIDTH as i32), tj::tj3Get(h, tj::TJPARAM_TJPARAM_JPEGHEIGHT as i32));
    if w <= 0 || hh <= 0 {
        return Err(format!("JPEG (libjpeg-turbo): no size in the header ({w}×{hh})"));
    }
    let (width, height) = (w as usize, hh as usize);
    let full = Region { x0: 0.0, y0: 0.0, w: width as f32, h: height as f32 };
    let (r, rect, region) = match want(width, height) {
        None => (1, [0, 0, width, height], full),
        Some((win, side)) => {
            let r = reduction(win, side);
            // libjpeg-turbo's scaled size (TJSCALED): ceil(dimension / r).
            let (sw, sh) = (width.div_ceil(r), height.div_ceil(r));
            let rf = r as f32;
            let s = Region { x0: win.x0 / rf, y0: win.y0 / rf, w: win.w / rf, h: win.h / rf };
            // The filter reads up to radius (2 for bicubic) × downscale factor beyond the
            // window, plus a pixel of rounding: taken on every side.
            let reach = |len: f32| (2.0 * (len / side.max(1) as f32).max(1.0)).ceil() as usize + 2;
            let (mx, my) = (reach(s.w), reach(s.h));
            let span = |lo: f32, len: f32, m: usize, n: usize| {
                let a = (lo.floor().max(0.0) as usize).saturating_sub(m).min(n.saturating_sub(1));
                let b = (((lo + len).ceil().max(0.0) as usize) + m).min(n);
                (a, b.max(a + 1))
            };
            let (mut x0, x1) = span(s.x0, s.w, mx, sw);
            let (y0, y1) = span(s.y0, s.h, my, sh);
            match mcu_width(tj::tj3Get(h, tj::TJPARAM_TJPARAM_SUBSAMP as i32)) {
                Some(m) => x0 -= x0 % m.div_ceil(r),
                None => x0 = 0,
            }
            let (x1, x0) = if x0 == 0 && x1 == sw && y0 == 0 && y1 == sh { (sw, 0) } else { (x1, x0) };
            let region = Region { x0: s.x0 - x0 as f32, y0: s.y0 - y0 as f32, w: s.w, h: s.h };
            (r, [x0, y0, x1 - x0, y1 - y0], region)
        }
    };
    if tj::tj3SetScalingFactor(h, tj::tjscalingfactor { num: 1, denom: r as i32 }) != 0 {
        return Err(message(h));
    }
    let whole = rect == [0, 0, width.div_ceil(r), height.div_ceil(r)];
    let crop = if whole { tj::tjregion { x: 0, y: 0, w: 0, h: 0 } } else { tj::tjregion { x: rect[0] as i32, y: rect[1] as i32, w: rect[2] as i32, h: rect[3] as i32 } };
    if tj::tj3SetCroppingRegion(h, crop) != 0 {
        return Err(message(h));
    }
    let (ow, oh) = (rect[2], rect[3]);
    let n = ow * oh * 3;
    if pixels.len() < n {
        pixels.resize(n, 0);
    }
    if tj::tj3Decompress8(h, bytes.as_ptr(), bytes.len() as _, pixels.as_mut_ptr(), (ow * 3) as i32, tj::TJPF_TJPF_RGB) != 0 {
        return Err(message(h));
    }
    Ok(Partial { width: ow, height: oh, region, source: (width, height), reduction: r })
}

#[cfg(all(test, feature = "turbojpeg"))]
mod tests {
    use super::*;
    use crate::config::Interpolation;
    use crate::data::resize;

    fn photo(name: &str) -> Vec<u8> {
        std::fs::read(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/fixtures/photos/{name}.jpg"))).unwrap()
    }

    #[test]
    fn reduction_keeps_the_window_at_least_the_output() {
        let win = |w: f32, h: f32| Region { x0: 0.0, y0: 0.0, w, h };
        assert_eq!(reduction(win(500.0, 375.0), 224), 1);
        assert_eq!(reduction(win(500.0, 448.0), 224), 2);
        assert_eq!(reduction(win(447.9, 900.0), 224), 1);
        assert_eq!(reduction(win(1000.0, 1000.0), 224), 4);
        assert_eq!(reduction(win(4000.0, 3000.0), 224), 8);
        assert_eq!(reduction(win(300.0, 300.0), 64), 4);
    }

    /// Resampling a cropped decode gives what resampling the whole image decoded at the same
    /// scale gives (colour 4:2:0 and greyscale files, every reduction): the rectangle holds every
    /// pixel the filter reads. (libjpeg-turbo's chroma upsampling treats a crop's first column
    /// as an image edge, so the rectangle's border columns are not the whole decode's; the
    /// margin keeps the filter off them.)
    #[test]
    fn cropped_decode_resamples_as_the_whole_decode() {
        for name in ["astronaut", "camera", "coffee"] {
            let bytes = photo(name);
            let wins = [(20, Region { x0: 37.0, y0: 51.0, w: 170.0, h: 150.0 }), (40, Region { x0: 101.0, y0: 9.0, w: 90.0, h: 170.0 }), (64, Region { x0: 200.0, y0: 100.0, w: 70.0, h: 66.0 }), (48, Region { x0: 33.5, y0: 70.25, w: 100.0, h: 120.0 })];
            for (side, win) in wins {
                for filter in [Interpolation::Bilinear, Interpolation::Bicubic] {
                    let (mut part, mut whole) = (Vec::new(), Vec::new());
                    let p = decode(&bytes, |_, _| Some((win, side)), &mut part).unwrap();
                    assert!(p.width < p.source.0.div_ceil(p.reduction), "{name}: a crop decodes fewer columns");
                    // the same scale, uncropped: a window covering the image at the same reduction
                    let r = p.reduction;
                    let f = decode_whole(&bytes, r, &mut whole).unwrap();
                    assert_eq!((f.reduction, f.width, f.height), (r, p.source.0.div_ceil(r), p.source.1.div_ceil(r)), "{name}");
                    let rf = r as f32;
                    let scaled = Region { x0: win.x0 / rf, y0: win.y0 / rf, w: win.w / rf, h: win.h / rf };
                    let (mut a, mut b) = (vec![0f32; 3 * side * side], vec![0f32; 3 * side * side]);
                    resize::resample(&part, p.width, p.height, p.region, side, false, filter, [0.0; 3], [1.0 / 255.0; 3], &mut a);
                    resize::resample(&whole, f.width, f.height, scaled, side, false, filter, [0.0; 3], [1.0 / 255.0; 3], &mut b);
                    let d = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
                    assert!(d < 1e-2, "{name} side {side} {filter:?} 1/{r}: max difference {d}");
                }
            }
        }
    }

    /// The reduced-scale decode of a crop resampled to the output gives the full decode's image
    /// up to resampling error, on real photographs, several output sizes (so every reduction
    /// occurs) and both filters. The yardstick is the full path's own filter choice: the
    /// reduction (a scaled IDCT, a sharper low-pass inside each block, before the antialiased
    /// filter) may move the image about as far as bilinear vs bicubic on the same window does —
    /// per case within 1.5× that plus half a level, and less than it summed over all cases — and
    /// no pixel by 48 levels or more (strong edges of the most detailed photo at 1/8 reach ~40).
    /// Without a reduction (a crop of the libjpeg-turbo decode) only the decoders' IDCT and
    /// chroma upsampling differ: mean under half a level, no pixel over 4.
    #[test]
    fn reduced_scale_matches_the_full_decode_within_resampling_error() {
        let mut worst = (0.0f64, 0u8);
        let mut sums = (0.0, 0.0);
        for name in ["astronaut", "camera", "chelsea", "coffee", "rocket"] {
            let bytes = photo(name);
            let mut full = Vec::new();
            let (w, h) = crate::core::encoded::decode_rgb(&bytes, &mut full).unwrap();
            for (k, side) in [(0u64, 32usize), (1, 48), (2, 64), (3, 96), (4, 24)] {
                for filter in [Interpolation::Bilinear, Interpolation::Bicubic] {
                    let (win, _) = resize::draw_rrc(7, k, 3, w, h, [0.25, 1.0], [0.75, 4.0 / 3.0]);
                    let mut part = Vec::new();
                    let p = decode(&bytes, |_, _| Some((win, side)), &mut part).unwrap();
                    let (mut a, mut b) = (vec![0u8; 3 * side * side], vec![0u8; 3 * side * side]);
                    resize::resample_u8(&full, w, h, win, side, false, filter, &mut a);
                    resize::resample_u8(&part, p.width, p.height, p.region, side, false, filter, &mut b);
                    let d: Vec<u8> = a.iter().zip(&b).map(|(x, y)| x.abs_diff(*y)).collect();
                    let mean = d.iter().map(|&x| x as f64).sum::<f64>() / d.len() as f64;
                    let max = *d.iter().max().unwrap();
                    let other = if filter == Interpolation::Bilinear { Interpolation::Bicubic } else { Interpolation::Bilinear };
                    let mut c = vec![0u8; 3 * side * side];
                    resize::resample_u8(&full, w, h, win, side, false, other, &mut c);
                    let fmean = a.iter().zip(&c).map(|(x, y)| x.abs_diff(*y) as f64).sum::<f64>() / d.len() as f64;
                    eprintln!("{name} side {side} {filter:?}: 1/{} window {:.0}×{:.0}: mean |diff| {mean:.3}, max {max}; bilinear vs bicubic {fmean:.3}", p.reduction, win.w, win.h);
                    worst = (worst.0.max(mean), worst.1.max(max));
                    let case = format!("{name} side {side} {filter:?} 1/{}: mean {mean:.3} max {max}, bilinear vs bicubic {fmean:.3}", p.reduction);
                    if p.reduction == 1 {
                        assert!(mean < 0.5 && max <= 4, "{case}");
                    } else {
                        assert!(mean <= 1.5 * fmean + 0.5 && max < 48, "{case}");
                        sums = (sums.0 + mean, sums.1 + fmean);
                    }
                }
            }
        }
        eprintln!("worst: mean {:.3}, max {}; summed means, reduced {:.2}, bilinear vs bicubic {:.2}", worst.0, worst.1, sums.0, sums.1);
        assert!(sums.0 < sums.1, "{sums:?}");
    }

    /// Damaged files: an error (never a panic) for the caller to fall back on.
    #[test]
    fn damaged_files_are_errors() {
        let bytes = photo("chelsea");
        let mut px = Vec::new();
        let win = Region { x0: 10.0, y0: 10.0, w: 150.0, h: 150.0 };
        assert!(decode(&bytes[..bytes.len() / 2], |_, _| Some((win, 32)), &mut px).is_err());
        assert!(decode(&bytes[..40], |_, _| Some((win, 32)), &mut px).is_err());
        assert!(decode(b"not a jpeg at all", |_, _| None, &mut px).is_err());
        let mut garbled = bytes.clone();
        for b in garbled[600..900].iter_mut() {
            *b = 0xff;
        }
        let _ = decode(&garbled, |_, _| Some((win, 32)), &mut px);
        // still usable afterwards
        assert!(decode(&bytes, |_, _| Some((win, 32)), &mut px).is_ok());
    }
}

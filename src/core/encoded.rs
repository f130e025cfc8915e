//! A batch whose images are still encoded: what the loader hands a backend that decodes on the
//! device (`data.decode = "gpu"`). The loader's threads only read the files, parse each JPEG's
//! header for its size and draw the crop and flip; the device decodes, resamples, flips and
//! normalizes into the model's input.
//!
//! It lives here, below both `data` (which fills it) and `backend` (which decodes it), so
//! neither layer names the other.

/// How one image's bytes are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Encoding {
    /// A JPEG file, as read.
    Jpeg,
    /// Already decoded (height, width, 3) RGB8: formats the device cannot decode (PNG, WebP),
    /// decoded by the loader's threads.
    Rgb,
}

/// One image of an encoded batch.
#[derive(Clone, Debug, PartialEq)]
pub struct EncodedImage {
    pub bytes: Vec<u8>,
    pub encoding: Encoding,
    /// Size in pixels as the file's header states it (the size the decoder produces).
    pub width: usize,
    pub height: usize,
    /// The crop window in source pixels: x0, y0, width, height (RandomResizedCrop's draw, or
    /// the evaluation's center crop).
    pub crop: [f32; 4],
    /// Mirror the output horizontally.
    pub flip: bool,
    /// Where the image came from (a file, or a shard member), for error messages.
    pub source: String,
}

/// The encoded images of one micro-batch and how to turn them into the model's input.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EncodedBatch {
    pub images: Vec<EncodedImage>,
    /// Output side S: each image becomes (3, S, S).
    pub side: usize,
    /// PIL's antialiased bicubic filter; false: bilinear (`data.interpolation`).
    pub bicubic: bool,
    /// Normalization after scaling pixels to [0, 1]: (x − mean) / std per channel.
    pub mean: [f32; 3],
    pub std: [f32; 3],
}

impl EncodedBatch {
    pub fn len(&self) -> usize {
        self.images.len()
    }

    pub fn is_empty(&self) -> bool {
        self.images.is_empty()
    }
}

/// Decodes image file bytes (JPEG through zune-jpeg straight into the reused buffer, other
/// formats through the image crate) to (height, width, 3) RGB8 at the start of `pixels`
/// (which may be longer), returning (width, height); the error is the decoder's message. The
/// CPU's decoder, shared by the loader and by a device decoder's last resort.
pub fn decode_rgb(file: &[u8], pixels: &mut Vec<u8>) -> Result<(usize, usize), String> {
    if file.starts_with(&[0xff, 0xd8, 0xff]) {
        let mut dec = jpeg_decoder(file);
        dec.decode_headers().map_err(|e| format!("JPEG: {e}"))?;
        let (w, h) = dec.dimensions().ok_or("JPEG: no dimensions")?;
        let n = dec.output_buffer_size().ok_or("JPEG: image too large")?;
        if n != w * h * 3 {
            return Err(format!("JPEG: unexpected output size {n} for {w}×{h} RGB"));
        }
        if pixels.len() < n {
            pixels.resize(n, 0);
        }
        dec.decode_into(&mut pixels[..n]).map_err(|e| format!("JPEG: {e}"))?;
        return Ok((w, h));
    }
    let img = image::load_from_memory(file).map_err(|e| e.to_string())?.into_rgb8();
    let (w, h) = (img.width() as usize, img.height() as usize);
    *pixels = img.into_raw();
    Ok((w, h))
}


/// A JPEG's (width, height) from its headers, without decoding the scan (the same decoder and
/// options as [`decode_rgb`], so the size is the one a decode produces).
pub fn jpeg_size(bytes: &[u8]) -> Result<(usize, usize), String> {
    let mut dec = jpeg_decoder(bytes);
    dec.decode_headers().map_err(|e| format!("JPEG: {e}"))?;
    dec.dimensions().ok_or_else(|| "JPEG: no dimensions".to_string())
}

/// zune-jpeg with the image crate's leniency, no size limit, RGB output.
fn jpeg_decoder(bytes: &[u8]) -> zune_jpeg::JpegDecoder<zune_jpeg::zune_core::bytestream::ZCursor<&[u8]>> {
    use zune_jpeg::zune_core::{bytestream::ZCursor, colorspace::ColorSpace, options::DecoderOptions};
    let options = DecoderOptions::default()
        .set_strict_mode(false)
        .set_max_width(usize::MAX)
        .set_max_height(usize::MAX)
        .jpeg_set_out_colorspace(ColorSpace::RGB);
    zune_jpeg::JpegDecoder::new_with_options(ZCursor::new(bytes), options)
}

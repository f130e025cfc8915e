//! A bounds-checked, strided wrapper over the `gemm` crate's f32 kernel: every CPU matrix
//! product goes through here, so the one `unsafe` call sits behind one check.

use gemm::Parallelism;

use crate::backend::{BResult, BackendError};

/// A read-only strided matrix view: element (r, c) is `data[off + r·rs + c·cs]`.
#[derive(Clone, Copy)]
pub struct Mat<'a> {
    pub data: &'a [f32],
    pub off: usize,
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
}

/// A writable strided matrix view.
pub struct MatMut<'a> {
    pub data: &'a mut [f32],
    pub off: usize,
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
}

impl<'a> Mat<'a> {
    /// A dense row-major (rows, cols) matrix at the start of `data`.
    pub fn rows(data: &'a [f32], rows: usize, cols: usize) -> Self {
        Mat { data, off: 0, rows, cols, rs: cols, cs: 1 }
    }
    /// The transpose of a dense row-major (rows, cols) matrix: a (cols, rows) view.
    pub fn rows_t(data: &'a [f32], rows: usize, cols: usize) -> Self {
        Mat { data, off: 0, rows: cols, cols: rows, rs: 1, cs: cols }
    }
    fn last(&self) -> usize {
        self.off + (self.rows.saturating_sub(1)) * self.rs + (self.cols.saturating_sub(1)) * self.cs
    }
}

impl<'a> MatMut<'a> {
    pub fn rows(data: &'a mut [f32], rows: usize, cols: usize) -> Self {
        MatMut { data, off: 0, rows, cols, rs: cols, cs: 1 }
    }
    fn last(&self) -> usize {
        self.off + (self.rows.saturating_sub(1)) * self.rs + (self.cols.saturating_sub(1)) * self.cs
    }
}

/// `dst = a · b` (or `dst += a · b` with `accumulate`). `parallel` spreads the product over
/// the rayon pool; callers already inside a parallel loop pass `false`.
pub fn matmul(dst: MatMut<'_>, a: Mat<'_>, b: Mat<'_>, accumulate: bool, parallel: bool) -> BResult<()> {
    let (m, n, k) = (dst.rows, dst.cols, a.cols);
    if a.rows != m || b.rows != k || b.cols != n {
        return Err(BackendError::Shape {
            op: "gemm",
            msg: format!("({}x{}) = ({}x{}) · ({}x{})", m, n, a.rows, a.cols, b.rows, b.cols),
        });
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        if !accumulate {
            for r in 0..m {
                for c in 0..n {
                    dst.data[dst.off + r * dst.rs + c * dst.cs] = 0.0;
                }
            }
        }
        return Ok(());
    }
    if a.last() >= a.data.len() || b.last() >= b.data.len() || dst.last() >= dst.data.len() {
        return Err(BackendError::Shape { op: "gemm", msg: "view exceeds its buffer".into() });
    }
    let par = if parallel { Parallelism::Rayon(0) } else { Parallelism::None };
    // SAFETY: the three views were checked above to lie inside their slices (strides are
    // non-negative, so the last element bounds every element); `dst` is borrowed mutably and
    // cannot alias `a` or `b`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.data.as_mut_ptr().add(dst.off),
            dst.cs as isize,
            dst.rs as isize,
            accumulate,
            a.data.as_ptr().add(a.off),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr().add(b.off),
            b.cs as isize,
            b.rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            par,
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strided_product_matches_naive() {
        let (m, n, k) = (5, 7, 3);
        let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let bt: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.11).cos()).collect(); // (n, k)
        let mut c = vec![1.0f32; m * n];
        matmul(MatMut::rows(&mut c, m, n), Mat::rows(&a, m, k), Mat::rows_t(&bt, n, k), true, false).unwrap();
        for i in 0..m {
            for j in 0..n {
                let want: f32 = 1.0 + (0..k).map(|p| a[i * k + p] * bt[j * k + p]).sum::<f32>();
                assert!((c[i * n + j] - want).abs() < 1e-5);
            }
        }
        let bad = matmul(MatMut::rows(&mut c, m, n), Mat::rows(&a, m, k), Mat::rows(&a, m, k), false, false);
        assert!(bad.is_err());
    }
}

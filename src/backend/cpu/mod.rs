//! The CPU backend: f32, all cores (rayon), GEMMs through the `gemm` crate. The reference
//! every other backend is tested against.

pub mod optim;

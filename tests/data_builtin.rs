//! The built-in dataset must need a real vision model: a linear (softmax) classifier on raw
//! pixels, trained to convergence, has to stay far from the > 95 % a small ViT reaches.

use vitscale::data::{builtin, rng::stream};

/// Softmax regression on standardized pixels, full-batch gradient descent with momentum.
fn linear_probe_accuracy(side: usize) -> f64 {
    let train = builtin::generate(4000, side, 3, stream::TRAIN);
    let val = builtin::generate(1000, side, 3, stream::VAL);
    let d = side * side * 3;
    let feats = |images: &[u8]| -> Vec<f32> { images.iter().map(|&p| p as f32 / 127.5 - 1.0).collect() };
    let (xt, xv) = (feats(&train.images), feats(&val.images));
    let k = 10;
    let mut w = vec![0f32; k * (d + 1)];
    let mut vel = vec![0f32; w.len()];
    let n = train.len();
    for _ in 0..150 {
        let mut grad = vec![0f32; w.len()];
        for i in 0..n {
            let x = &xt[i * d..(i + 1) * d];
            let mut logits: Vec<f32> = (0..k).map(|c| w[c * (d + 1) + d] + x.iter().zip(&w[c * (d + 1)..c * (d + 1) + d]).map(|(a, b)| a * b).sum::<f32>()).collect();
            let m = logits.iter().cloned().fold(f32::MIN, f32::max);
            let z: f32 = logits.iter_mut().map(|l| { *l = (*l - m).exp(); *l }).sum();
            for c in 0..k {
                let g = logits[c] / z - f32::from(c == train.labels[i] as usize);
                let row = &mut grad[c * (d + 1)..(c + 1) * (d + 1)];
                for j in 0..d {
                    row[j] += g * x[j];
                }
                row[d] += g;
            }
        }
        for j in 0..w.len() {
            vel[j] = 0.9 * vel[j] + grad[j] / n as f32;
            w[j] -= 0.05 * vel[j];
        }
    }
    let correct = (0..val.len())
        .filter(|&i| {
            let x = &xv[i * d..(i + 1) * d];
            let score = |c: usize| w[c * (d + 1) + d] + x.iter().zip(&w[c * (d + 1)..c * (d + 1) + d]).map(|(a, b)| a * b).sum::<f32>();
            (0..k).max_by(|&a, &b| score(a).total_cmp(&score(b))) == Some(val.labels[i] as usize)
        })
        .count();
    correct as f64 / val.len() as f64
}

#[test]
fn linear_probe_is_far_from_perfect() {
    let acc = linear_probe_accuracy(16);
    eprintln!("linear probe on raw 16-px pixels: val top-1 {acc:.3}");
    assert!(acc > 0.12, "the probe should beat chance a little (shape area leaks): {acc:.3}");
    assert!(acc < 0.6, "a linear classifier on raw pixels separates the classes: {acc:.3}");
}

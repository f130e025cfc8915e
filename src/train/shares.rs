//! The arithmetic of splitting a global batch over ranks in shares: the unit a share is counted
//! in, largest-remainder apportioning, a run's starting split and the widest micro-batch a rank
//! can be given. The plan (`train::plan`) and the balancer (`train::balance`) both use it.

use crate::config::{Balance, RunConfig};

/// Images per share unit: mixing pairs neighbours, so each size must be even.
pub fn unit(cfg: &RunConfig) -> usize {
    if cfg.data.aug.mixes() {
        2
    } else {
        1
    }
}

/// `total` split into sizes proportional to `weights` (positive), each a multiple of `unit`
/// and at least one unit, summing to `total` (a multiple of `unit`, at least `unit` per
/// weight): largest remainder, ties to the lower rank; a rank raised to its one unit is paid
/// for by the rank most over its proportional value.
pub fn apportion(total: usize, weights: &[f64], unit: usize) -> Vec<usize> {
    let n = weights.len();
    let units = total / unit;
    debug_assert!(units >= n && total.is_multiple_of(unit));
    let sum: f64 = weights.iter().sum();
    let exact: Vec<f64> = weights.iter().map(|w| w / sum * units as f64).collect();
    let mut got: Vec<usize> = exact.iter().map(|x| (x.floor() as usize).max(1)).collect();
    // the rank furthest below (above) its proportional value, the lower rank on ties
    let pick = |got: &[usize], below: bool| -> Option<usize> {
        (0..n)
            .filter(|&r| below || got[r] > 1)
            .max_by(|&a, &b| {
                let (da, db) = (exact[a] - got[a] as f64, exact[b] - got[b] as f64);
                let ord = if below { da.total_cmp(&db) } else { db.total_cmp(&da) };
                ord.then(b.cmp(&a))
            })
    };
    while got.iter().sum::<usize>() < units {
        let Some(r) = pick(&got, true) else { break };
        got[r] += 1;
    }
    while got.iter().sum::<usize>() > units {
        let Some(r) = pick(&got, false) else { break };
        got[r] -= 1;
    }
    got.iter().map(|g| g * unit).collect()
}

/// The largest micro-batch a rank can be given under `balance` (None: equal split), so the
/// plan can size its passes for it.
pub fn widest_micro(balance: &Balance, world: usize, micro: usize, unit: usize) -> Option<usize> {
    match balance {
        Balance::Off => None,
        Balance::Shares(s) => apportion(world * micro, s, unit).into_iter().max(),
        Balance::Auto => Some(world * micro - (world - 1) * unit),
    }
}

/// Each rank's micro-batch at the start of a run: fixed shares apportioned, else the equal split
/// (`auto` starts there).
pub fn initial_split(balance: &Balance, world: usize, micro: usize, unit: usize) -> Vec<usize> {
    match balance {
        Balance::Shares(s) => apportion(world * micro, s, unit),
        Balance::Off | Balance::Auto => vec![micro; world],
    }
}

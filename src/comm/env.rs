//! Where this process sits in the job: rank, world size, local rank, and where rank 0 serves
//! rendezvous, read from the variables of whichever launcher started us.
//!
//! Precedence (first match wins): torchrun / `vitscale launch` (`RANK`, `WORLD_SIZE`, …),
//! Open MPI (`OMPI_COMM_WORLD_*`), MPICH / PMI (`PMI_RANK`, `PMI_SIZE`), SLURM
//! (`SLURM_PROCID`, …). The explicit launchers come before SLURM because `mpirun` or
//! `vitscale launch` are often run *inside* a SLURM allocation, whose `SLURM_*` variables then
//! describe the allocation's batch step, not our workers. No variables = a single process.
//!
//! `MASTER_ADDR` / `MASTER_PORT` override the rendezvous address for every source; SLURM
//! defaults the address to the first host of `SLURM_JOB_NODELIST` (compressed lists such as
//! `node[01-04,07]` are expanded here).

use std::time::Duration;

/// Default rendezvous port (torchrun's).
pub const DEFAULT_MASTER_PORT: u16 = 29500;

// The launcher ↔ worker contract of `vitscale launch` (the launcher sets these, a worker
// reads them): declared here, below both, so neither imports the other.

/// The GPU a worker opens, when set (`launch --one-gpu` sets 0); otherwise its `LOCAL_RANK`.
pub const DEVICE_INDEX_VAR: &str = "VITSCALE_DEVICE_INDEX";

/// The file `launch --one-gpu` gives each worker to create once its device is open
/// (`signal_device_ready`); the next rank starts after it appears.
pub const DEVICE_READY_VAR: &str = "VITSCALE_DEVICE_READY";

/// Called by a worker once its device is open and before it meets the other ranks: creates
/// the file of `DEVICE_READY_VAR`, if the launcher set one.
pub fn signal_device_ready() {
    if let Some(path) = std::env::var_os(DEVICE_READY_VAR).filter(|p| !p.is_empty()) {
        // best effort: without it the launcher starts the next rank after its timeout
        let _ = std::fs::write(path, b"");
    }
}


/// Which launcher's variables described this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EnvSource {
    Single,
    Torchrun,
    OpenMpi,
    Pmi,
    Slurm,
}

/// The process layout of a (possibly) distributed run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DistEnv {
    pub rank: usize,
    pub world_size: usize,
    /// Rank among the processes of this node: selects the GPU.
    pub local_rank: usize,
    pub local_world_size: usize,
    /// Host rank 0 serves rendezvous on.
    pub master_addr: String,
    pub master_port: u16,
    pub source: EnvSource,
}

/// A launcher variable that is missing or malformed. Names the variable and its value.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EnvError {
    #[error("environment variable {var}={value:?} is not valid: {why}")]
    Bad { var: &'static str, value: String, why: String },
    #[error("environment variable {var} is required when {because} is set")]
    Missing { var: &'static str, because: &'static str },
    #[error("{var}={value:?}: rank {rank} is not below the world size {world} ({world_var})")]
    RankOutOfRange { var: &'static str, value: String, rank: usize, world: usize, world_var: &'static str },
    #[error("cannot parse SLURM node list {list:?}: {why}")]
    NodeList { list: String, why: String },
}

impl DistEnv {
    /// Rank `rank` of `world` processes (or threads) on this machine, rendezvous on loopback
    /// port `port`: an in-process world, as tests and single-machine tools build one.
    pub fn loopback(rank: usize, world: usize, port: u16) -> DistEnv {
        DistEnv { rank, world_size: world, local_rank: rank, local_world_size: world, master_addr: "127.0.0.1".into(), master_port: port, source: EnvSource::Torchrun }
    }

    /// A single process: rank 0 of 1, rendezvous never used.
    pub fn single() -> Self {
        DistEnv {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: 1,
            master_addr: "127.0.0.1".to_string(),
            master_port: DEFAULT_MASTER_PORT,
            source: EnvSource::Single,
        }
    }

    /// Reads the process environment.
    pub fn detect() -> Result<Self, EnvError> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// As `detect`, reading variables through `get` (so tests need not touch the process
    /// environment, which is shared by the test threads).
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self, EnvError> {
        let get = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        let mut env = if get("RANK").is_some() || get("WORLD_SIZE").is_some() {
            let rank = num(&get, "RANK", "WORLD_SIZE")?;
            let world = positive(&get, "WORLD_SIZE", "RANK")?;
            let local_rank = opt_num(&get, "LOCAL_RANK")?.unwrap_or(rank);
            let local_world = opt_num(&get, "LOCAL_WORLD_SIZE")?.unwrap_or(world);
            DistEnv::layout(EnvSource::Torchrun, rank, world, local_rank, local_world)
        } else if get("OMPI_COMM_WORLD_RANK").is_some() {
            let rank = num(&get, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_RANK")?;
            let world = positive(&get, "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")?;
            let local_rank = opt_num(&get, "OMPI_COMM_WORLD_LOCAL_RANK")?.unwrap_or(rank);
            let local_world = opt_num(&get, "OMPI_COMM_WORLD_LOCAL_SIZE")?.unwrap_or(world);
            DistEnv::layout(EnvSource::OpenMpi, rank, world, local_rank, local_world)
        } else if get("PMI_RANK").is_some() {
            let rank = num(&get, "PMI_RANK", "PMI_RANK")?;
            let world = positive(&get, "PMI_SIZE", "PMI_RANK")?;
            // MPICH's Hydra sets MPI_LOCALRANKID; without it assume one node.
            let local_rank = opt_num(&get, "MPI_LOCALRANKID")?.unwrap_or(rank);
            let local_world = opt_num(&get, "MPI_LOCALNRANKS")?.unwrap_or(world);
            DistEnv::layout(EnvSource::Pmi, rank, world, local_rank, local_world)
        } else if get("SLURM_PROCID").is_some() {
            let rank = num(&get, "SLURM_PROCID", "SLURM_PROCID")?;
            let world = positive(&get, "SLURM_NTASKS", "SLURM_PROCID")?;
            let local_rank = opt_num(&get, "SLURM_LOCALID")?.unwrap_or(0);
            let local_world = match (get("SLURM_TASKS_PER_NODE"), opt_num(&get, "SLURM_NODEID")?) {
                (Some(tpn), Some(node)) => tasks_on_node(&tpn, node)
                    .map_err(|why| EnvError::Bad { var: "SLURM_TASKS_PER_NODE", value: tpn.clone(), why })?,
                _ => world,
            };
            let mut e = DistEnv::layout(EnvSource::Slurm, rank, world, local_rank, local_world);
            let list = get("SLURM_JOB_NODELIST").or_else(|| get("SLURM_NODELIST"));
            if let Some(list) = list {
                e.master_addr = first_host(&list)?;
            }
            // Jobs sharing a node must not share a port: offset the default by the job id.
            if let Some(job) = opt_num(&get, "SLURM_JOB_ID")? {
                e.master_port = DEFAULT_MASTER_PORT + (job % 1000) as u16;
            }
            e
        } else {
            DistEnv::single()
        };

        if env.rank >= env.world_size {
            let (rv, wv) = match env.source {
                EnvSource::Torchrun => ("RANK", "WORLD_SIZE"),
                EnvSource::OpenMpi => ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                EnvSource::Pmi => ("PMI_RANK", "PMI_SIZE"),
                EnvSource::Slurm => ("SLURM_PROCID", "SLURM_NTASKS"),
                EnvSource::Single => ("RANK", "WORLD_SIZE"),
            };
            return Err(EnvError::RankOutOfRange {
                var: rv,
                value: env.rank.to_string(),
                rank: env.rank,
                world: env.world_size,
                world_var: wv,
            });
        }
        if env.local_rank >= env.local_world_size {
            return Err(EnvError::Bad {
                var: "LOCAL_RANK",
                value: env.local_rank.to_string(),
                why: format!("not below the local world size {}", env.local_world_size),
            });
        }
        if let Some(a) = get("MASTER_ADDR") {
            env.master_addr = a.trim().to_string();
        } else if env.source != EnvSource::Slurm && env.world_size > env.local_world_size {
            // Several nodes and nobody said where rank 0 is: guessing loopback would hang.
            return Err(EnvError::Missing { var: "MASTER_ADDR", because: "a multi-node world" });
        }
        if let Some(p) = get("MASTER_PORT") {
            env.master_port = p.trim().parse::<u16>().ok().filter(|&p| p > 0).ok_or_else(|| EnvError::Bad {
                var: "MASTER_PORT",
                value: p.clone(),
                why: "expected a port number 1-65535".into(),
            })?;
        }
        Ok(env)
    }

    fn layout(source: EnvSource, rank: usize, world: usize, local_rank: usize, local_world: usize) -> Self {
        DistEnv { rank, world_size: world, local_rank, local_world_size: local_world, source, ..DistEnv::single() }
    }

    pub fn is_distributed(&self) -> bool {
        self.world_size > 1
    }
}

/// Variables that name one job to every one of its ranks, different between jobs: the
/// rendezvous refuses a process of another job that reached this job's port (two runs given
/// the same `MASTER_PORT`). First one set wins; vitscale launch sets `VITSCALE_JOB_ID`.
pub const JOB_ID_VARS: &[&str] = &["VITSCALE_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid"];

/// This job's identity from the launcher's variables (see [`JOB_ID_VARS`]; a SLURM job adds
/// its step), or "" when no launcher names the job (every peer is then accepted).
pub fn job_id_from(get: impl Fn(&str) -> Option<String>) -> String {
    let get = |k: &str| get(k).map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
    for var in JOB_ID_VARS {
        // torchrun's default rdzv id is the literal "none": it names no job.
        if let Some(v) = get(var).filter(|v| v != "none") {
            return match (*var, get("SLURM_STEP_ID")) {
                ("SLURM_JOB_ID", Some(step)) => format!("slurm-{v}.{step}"),
                ("SLURM_JOB_ID", None) => format!("slurm-{v}"),
                _ => v,
            };
        }
    }
    String::new()
}

/// [`job_id_from`] the process environment.
pub fn job_id() -> String {
    job_id_from(|k| std::env::var(k).ok())
}

fn parse_num(var: &'static str, v: &str) -> Result<usize, EnvError> {
    v.trim().parse::<usize>().map_err(|_| EnvError::Bad {
        var,
        value: v.to_string(),
        why: "expected a non-negative integer".into(),
    })
}

fn num(get: &impl Fn(&str) -> Option<String>, var: &'static str, because: &'static str) -> Result<usize, EnvError> {
    match get(var) {
        Some(v) => parse_num(var, &v),
        None => Err(EnvError::Missing { var, because }),
    }
}

fn positive(get: &impl Fn(&str) -> Option<String>, var: &'static str, because: &'static str) -> Result<usize, EnvError> {
    let n = num(get, var, because)?;
    if n == 0 {
        return Err(EnvError::Bad { var, value: "0".into(), why: "the world size must be at least 1".into() });
    }
    Ok(n)
}

fn opt_num(get: &impl Fn(&str) -> Option<String>, var: &'static str) -> Result<Option<usize>, EnvError> {
    get(var).map(|v| parse_num(var, &v)).transpose()
}

/// Reads an optional duration in seconds (fractional allowed, > 0).
pub(crate) fn seconds_var(get: &impl Fn(&str) -> Option<String>, var: &'static str) -> Result<Option<Duration>, EnvError> {
    let Some(v) = get(var).filter(|v| !v.trim().is_empty()) else { return Ok(None) };
    match v.trim().parse::<f64>() {
        Ok(s) if s > 0.0 && s.is_finite() => Ok(Some(Duration::from_secs_f64(s))),
        _ => Err(EnvError::Bad { var, value: v, why: "expected a positive number of seconds".into() }),
    }
}

/// Tasks on node `node` from SLURM's `SLURM_TASKS_PER_NODE`, e.g. `4(x2),3` = 4, 4, 3.
fn tasks_on_node(spec: &str, node: usize) -> Result<usize, String> {
    let mut seen = 0usize;
    for part in spec.split(',') {
        let (count, reps) = match part.split_once("(x") {
            Some((c, r)) => (c, r.strip_suffix(')').ok_or_else(|| format!("unclosed repeat in {part:?}"))?),
            None => (part, "1"),
        };
        let count: usize = count.trim().parse().map_err(|_| format!("bad task count {count:?}"))?;
        let reps: usize = reps.trim().parse().map_err(|_| format!("bad repeat count {reps:?}"))?;
        if node < seen + reps {
            return Ok(count);
        }
        seen += reps;
    }
    Err(format!("describes {seen} nodes, SLURM_NODEID is {node}"))
}

/// The first host of a SLURM node list (the rendezvous host by convention).
pub fn first_host(list: &str) -> Result<String, EnvError> {
    expand_nodelist(list)?
        .into_iter()
        .next()
        .ok_or_else(|| EnvError::NodeList { list: list.to_string(), why: "no hosts".into() })
}

/// Expands a SLURM compressed node list: `node[01-04,07],gpu-a` → node01, node02, node03,
/// node04, node07, gpu-a. Ranges keep the zero padding of their first bound; several bracket
/// groups in one name expand as their product (`r[1-2]n[1-2]` → r1n1, r1n2, r2n1, r2n2).
pub fn expand_nodelist(list: &str) -> Result<Vec<String>, EnvError> {
    let err = |why: String| EnvError::NodeList { list: list.to_string(), why };
    let mut hosts = Vec::new();
    // Split on commas outside brackets.
    let mut depth = 0i32;
    let mut item = String::new();
    let mut items = Vec::new();
    for ch in list.trim().chars() {
        match ch {
            '[' => depth += 1,
            ']' => depth -= 1,
            _ => {}
        }
        if !(0..=1).contains(&depth) {
            return Err(err("unbalanced or nested brackets".into()));
        }
        if ch == ',' && depth == 0 {
            items.push(std::mem::take(&mut item));
        } else {
            item.push(ch);
        }
    }
    if depth != 0 {
        return Err(err("unbalanced brackets".into()));
    }
    items.push(item);
    for it in items {
        let it = it.trim();
        if it.is_empty() {
            return Err(err("empty host name".into()));
        }
        hosts.extend(expand_item(it).map_err(err)?);
    }
    Ok(hosts)
}

fn expand_item(item: &str) -> Result<Vec<String>, String> {
    let Some(open) = item.find('[') else { return Ok(vec![item.to_string()]) };
    let close = item[open..].find(']').ok_or("unclosed '['")? + open;
    let (prefix, body, rest) = (&item[..open], &item[open + 1..close], &item[close + 1..]);
    let tails = expand_item(rest)?;
    let mut out = Vec::new();
    for part in body.split(',') {
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        let width = lo.len();
        let a: u64 = lo.parse().map_err(|_| format!("bad range bound {lo:?}"))?;
        let b: u64 = hi.parse().map_err(|_| format!("bad range bound {hi:?}"))?;
        if b < a {
            return Err(format!("descending range {part:?}"));
        }
        if b - a > 100_000 {
            return Err(format!("range {part:?} is implausibly large"));
        }
        for n in a..=b {
            for t in &tails {
                out.push(format!("{prefix}{n:0width$}{t}"));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(vars: &[(&str, &str)]) -> Result<DistEnv, EnvError> {
        let m: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        DistEnv::from_vars(|k| m.get(k).cloned())
    }

    #[test]
    fn no_variables_is_single_process() {
        assert_eq!(env(&[]).unwrap(), DistEnv::single());
    }

    #[test]
    fn torchrun_variables() {
        let e = env(&[
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("MASTER_ADDR", "node01"),
            ("MASTER_PORT", "1234"),
        ])
        .unwrap();
        assert_eq!((e.rank, e.world_size, e.local_rank, e.local_world_size), (5, 8, 1, 4));
        assert_eq!((e.master_addr.as_str(), e.master_port, e.source), ("node01", 1234, EnvSource::Torchrun));
    }

    #[test]
    fn errors_name_variable_and_value() {
        let e = env(&[("RANK", "x1"), ("WORLD_SIZE", "2")]).unwrap_err();
        assert!(e.to_string().contains("RANK=\"x1\""), "{e}");
        let e = env(&[("RANK", "2"), ("WORLD_SIZE", "2")]).unwrap_err();
        assert!(matches!(e, EnvError::RankOutOfRange { rank: 2, world: 2, .. }), "{e}");
        let e = env(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "99999")]).unwrap_err();
        assert!(e.to_string().contains("MASTER_PORT=\"99999\""), "{e}");
        let e = env(&[("RANK", "0")]).unwrap_err();
        assert_eq!(e, EnvError::Missing { var: "WORLD_SIZE", because: "RANK" });
        // Multi-node without a master address must not silently pick loopback.
        let e = env(&[("RANK", "0"), ("WORLD_SIZE", "4"), ("LOCAL_WORLD_SIZE", "2")]).unwrap_err();
        assert!(e.to_string().contains("MASTER_ADDR"), "{e}");
    }

    #[test]
    fn open_mpi_and_pmi() {
        let e = env(&[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "3"),
        ])
        .unwrap();
        assert_eq!((e.rank, e.world_size, e.local_rank, e.source), (3, 4, 3, EnvSource::OpenMpi));
        let e = env(&[("PMI_RANK", "1"), ("PMI_SIZE", "2")]).unwrap();
        assert_eq!((e.rank, e.world_size, e.source), (1, 2, EnvSource::Pmi));
        let e = env(&[("PMI_RANK", "1")]).unwrap_err();
        assert_eq!(e, EnvError::Missing { var: "PMI_SIZE", because: "PMI_RANK" });
    }

    #[test]
    fn slurm_master_is_first_host_unless_set() {
        let base = [
            ("SLURM_PROCID", "6"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "2"),
            ("SLURM_NODEID", "1"),
            ("SLURM_TASKS_PER_NODE", "4(x2)"),
            ("SLURM_JOB_NODELIST", "gpu[07-08]"),
            ("SLURM_JOB_ID", "123456"),
        ];
        let e = env(&base).unwrap();
        assert_eq!((e.rank, e.world_size, e.local_rank, e.local_world_size), (6, 8, 2, 4));
        assert_eq!((e.master_addr.as_str(), e.master_port), ("gpu07", DEFAULT_MASTER_PORT + 456));
        let mut v = base.to_vec();
        v.push(("MASTER_ADDR", "10.0.0.1"));
        assert_eq!(env(&v).unwrap().master_addr, "10.0.0.1");
        // torchrun inside an allocation wins over the allocation's variables.
        v.extend([("RANK", "0"), ("WORLD_SIZE", "1")]);
        assert_eq!(env(&v).unwrap().source, EnvSource::Torchrun);
    }

    #[test]
    fn nodelists() {
        assert_eq!(
            expand_nodelist("node[01-04,07]").unwrap(),
            ["node01", "node02", "node03", "node04", "node07"]
        );
        assert_eq!(expand_nodelist("a,b[8-10],c").unwrap(), ["a", "b8", "b9", "b10", "c"]);
        assert_eq!(expand_nodelist("r[1-2]n[1-2]").unwrap(), ["r1n1", "r1n2", "r2n1", "r2n2"]);
        assert_eq!(first_host("gpu-a[003-005]").unwrap(), "gpu-a003");
        assert!(expand_nodelist("node[01-").is_err());
        assert!(expand_nodelist("node[5-3]").unwrap_err().to_string().contains("node[5-3]"));
        assert_eq!(tasks_on_node("4(x2),3", 2), Ok(3));
    }

    #[test]
    fn timeouts_from_env() {
        let m: HashMap<&str, &str> = [("VITSCALE_COMM_TIMEOUT", "2.5")].into();
        let o = super::super::CommOptions::from_vars(|k| m.get(k).map(|s| s.to_string())).unwrap();
        assert_eq!(o.timeout, Duration::from_millis(2500));
        let m: HashMap<&str, &str> = [("VITSCALE_RENDEZVOUS_TIMEOUT", "-1")].into();
        let e = super::super::CommOptions::from_vars(|k| m.get(k).map(|s| s.to_string())).unwrap_err();
        assert!(e.to_string().contains("VITSCALE_RENDEZVOUS_TIMEOUT=\"-1\""), "{e}");
    }
}

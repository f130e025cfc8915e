//! The flags of `vitscale launch` (`LaunchArgs`): what the launcher runs from, and what the
//! hostfile launcher renders again for each remote node.

use std::path::PathBuf;

use super::OutputMode;

/// Arguments of `vitscale launch`.
#[derive(Clone, Debug, clap::Args)]
#[command(after_help = "Examples:\n  vitscale launch --nproc-per-node 4 -- train --config run.json\n  vitscale launch --hostfile hosts --include node1:0,1@node2 -- train --config run.json")]
pub struct LaunchArgs {
    /// Worker processes per node (GPUs per node). Default 1; with --hostfile, each host's slots
    /// (then this caps the slots used per host, like DeepSpeed's --num_gpus).
    #[arg(long)]
    pub nproc_per_node: Option<usize>,
    /// Nodes in the run. With --hostfile: use only the first N hosts (DeepSpeed's --num_nodes).
    #[arg(long)]
    pub nnodes: Option<usize>,
    /// This node's index when launching by hand on each node (0 = the node of rank 0).
    #[arg(long, default_value_t = 0)]
    pub node_rank: usize,
    /// Address of rank 0's rendezvous. Default 127.0.0.1; with --hostfile, the first host.
    #[arg(long)]
    pub master_addr: Option<String>,
    /// Port of rank 0's rendezvous. Default: a free port when the whole run is on this node
    /// (so concurrent runs do not collide), else 29500.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    pub master_port: Option<u16>,
    /// DeepSpeed-style hostfile: one `hostname slots=N` per line, `#` comments.
    #[arg(long)]
    pub hostfile: Option<PathBuf>,
    /// Use only these hosts / slots: `host1:0,1@host2` (DeepSpeed's --include).
    #[arg(long, requires = "hostfile", conflicts_with = "exclude")]
    pub include: Option<String>,
    /// Skip these hosts / slots: `host1:0@host3` (DeepSpeed's --exclude).
    #[arg(long, requires = "hostfile")]
    pub exclude: Option<String>,
    /// Command that reaches a host (the host and the remote command are appended).
    #[arg(long, default_value = "ssh -o BatchMode=yes")]
    pub ssh: String,
    /// Which workers' stdout is shown.
    #[arg(long, value_enum, default_value_t = OutputMode::Rank0)]
    pub output: OutputMode,
    /// Seconds between SIGTERM and SIGKILL when stopping workers after one failed.
    #[arg(long, default_value_t = 5.0)]
    pub kill_grace: f64,
    /// Seconds workers get after a forwarded SIGINT / SIGTERM before SIGKILL: time to finish
    /// the optimizer step and write a checkpoint (`train.checkpoint_on_signal`). A second
    /// signal is forwarded at once (a worker then exits without checkpointing).
    #[arg(long, default_value_t = 30.0)]
    pub stop_grace: f64,
    /// (Set by the hostfile launcher for remote nodes.) Global rank of this node's first worker.
    #[arg(long, hide = true)]
    pub rank_offset: Option<usize>,
    /// (Set by the hostfile launcher.) Total ranks, when nodes have different slot counts.
    #[arg(long, hide = true)]
    pub world_size: Option<usize>,
    /// (Set by the hostfile launcher.) CUDA_VISIBLE_DEVICES for this node's workers.
    #[arg(long, hide = true)]
    pub visible_devices: Option<String>,
    /// Put every local rank on GPU 0, each as its own NCCL "node" (its own `NCCL_HOSTID`):
    /// NCCL then lets several ranks share one GPU and joins them over its Socket transport on
    /// loopback. Data parallelism on one GPU, to try and test it; the network is slow, so
    /// never a speed figure for NVLink.
    #[arg(long)]
    pub one_gpu: bool,
    /// (Set by the hostfile launcher.) Stop the workers when stdin closes: the ssh connection
    /// to the launching machine went away.
    #[arg(long, hide = true)]
    pub exit_on_stdin_eof: bool,
    /// Program to run as each worker instead of this executable (tests, wrappers).
    #[arg(long, hide = true)]
    pub worker_program: Option<PathBuf>,
    /// The worker command: `train ...` or `bench ...`.
    #[arg(last = true, required = true, num_args = 1..)]
    pub command: Vec<String>,
}

impl LaunchArgs {
    /// Arguments for launching `command` on `nproc` local workers (defaults elsewhere).
    pub fn local(nproc: usize, command: Vec<String>) -> Self {
        LaunchArgs {
            nproc_per_node: Some(nproc),
            nnodes: None,
            node_rank: 0,
            master_addr: None,
            master_port: None,
            hostfile: None,
            include: None,
            exclude: None,
            ssh: "ssh -o BatchMode=yes".into(),
            output: OutputMode::Rank0,
            kill_grace: 5.0,
            stop_grace: 30.0,
            rank_offset: None,
            world_size: None,
            visible_devices: None,
            one_gpu: false,
            exit_on_stdin_eof: false,
            worker_program: None,
            command,
        }
    }
}

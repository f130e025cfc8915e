//! The launcher supervising real processes: `/bin/sh` stands in for the worker program, so
//! these tests need no training code. Each is bounded to a few seconds (the bounds on elapsed
//! time are set far below what a failure would take and far above a loaded machine's delays).

use std::time::{Duration, Instant};

use vitscale::launch::{run, ExitDesc, LaunchArgs, LaunchError};

mod common;
use common::{free_port, tmp, EXE};

fn sh(nproc: usize, script: &str) -> LaunchArgs {
    let mut a = LaunchArgs::local(nproc, vec!["-c".into(), script.into()]);
    a.worker_program = Some("/bin/sh".into());
    a
}

#[test]
fn workers_get_torchrun_variables() {
    let dir = tmp();
    let d = dir.path().display().to_string();
    let mut a = sh(3, &format!(
        "echo \"$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK $MASTER_ADDR $MASTER_PORT\" > '{d}'/r$RANK"
    ));
    a.master_port = Some(31234);
    a.nnodes = Some(2);
    a.node_rank = 1;
    a.master_addr = Some("10.1.2.3".into());
    assert_eq!(run(a).expect("launch"), 0);
    for local in 0..3 {
        let rank = 3 + local;
        let got = std::fs::read_to_string(dir.path().join(format!("r{rank}"))).expect("worker wrote its variables");
        assert_eq!(got.trim(), format!("{rank} 6 {local} 3 1 10.1.2.3 31234"));
    }
}

#[test]
fn a_failing_worker_stops_the_others_and_is_named() {
    let t0 = Instant::now();
    let e = run(sh(3, "if [ \"$RANK\" = 1 ]; then sleep 0.2; exit 3; fi; sleep 30")).unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(10), "took {:?}", t0.elapsed());
    assert!(matches!(e, LaunchError::WorkerFailed { rank: 1, status: ExitDesc::Code(3), .. }), "{e}");
    assert!(e.to_string().contains("rank 1") && e.to_string().contains("exit status 3"), "{e}");
    assert_eq!(e.exit_code(), 3);
}

#[test]
fn a_killed_worker_is_named_with_its_signal() {
    let t0 = Instant::now();
    let e = run(sh(2, "if [ \"$RANK\" = 0 ]; then kill -9 $$; fi; sleep 30")).unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(10), "took {:?}", t0.elapsed());
    assert!(matches!(e, LaunchError::WorkerFailed { rank: 0, status: ExitDesc::Signal(9), .. }), "{e}");
    assert!(e.to_string().contains("SIGKILL"), "{e}");
    assert_eq!(e.exit_code(), 137);
}

#[test]
fn workers_that_ignore_sigterm_are_killed_after_the_grace_period() {
    let t0 = Instant::now();
    // rank 1 fails only after a pause, so rank 0's shell has installed its trap before the
    // launcher's SIGTERM arrives (exiting at once raced it: rank 0 then died of the TERM)
    let mut a = sh(2, "trap '' TERM; if [ \"$RANK\" = 1 ]; then sleep 0.3; exit 2; fi; while :; do sleep 0.1; done");
    a.kill_grace = 1.0;
    let e = run(a).unwrap_err();
    let took = t0.elapsed();
    // At least the 1 s grace (a machine's load can only lengthen it). Expected ≈ 1.3 s; a
    // launcher that never killed would hang here, so the upper bound only has to catch one
    // that is far too slow, and 15 s is beyond any load a 2-core machine sees.
    assert!(took >= Duration::from_millis(900) && took < Duration::from_secs(15), "took {took:?}");
    assert!(matches!(e, LaunchError::WorkerFailed { rank: 1, status: ExitDesc::Code(2), .. }), "{e}");
}

#[test]
fn bad_arguments_are_usage_errors() {
    let mut a = sh(2, "true");
    a.node_rank = 2;
    a.nnodes = Some(2);
    assert!(run(a).unwrap_err().to_string().contains("--node-rank 2 must be below --nnodes 2"));
    let mut a = sh(1, "true");
    a.worker_program = Some("/nonexistent/worker".into());
    let e = run(a).unwrap_err();
    assert!(matches!(e, LaunchError::Spawn { .. }) && e.to_string().contains("/nonexistent/worker"), "{e}");
}

#[test]
fn a_hostfile_naming_only_this_machine_runs_locally_on_the_chosen_slots() {
    let dir = tmp();
    let hosts = dir.path().join("hosts");
    std::fs::write(&hosts, "# one machine\nlocalhost slots=4\n").expect("write hostfile");
    let d = dir.path().display().to_string();
    let mut a = sh(1, &format!("echo \"$RANK $WORLD_SIZE $CUDA_VISIBLE_DEVICES\" > '{d}'/r$RANK"));
    a.nproc_per_node = None;
    a.hostfile = Some(hosts);
    a.include = Some("localhost:1,3".into());
    assert_eq!(run(a).expect("launch"), 0);
    for r in 0..2 {
        let got = std::fs::read_to_string(dir.path().join(format!("r{r}"))).expect("worker ran");
        assert_eq!(got.trim(), format!("{r} 2 1,3"));
    }
}

/// A stand-in for ssh: `fake_ssh HOST COMMAND` runs COMMAND here with sh in an almost empty
/// environment, as sshd would on another machine: only what the launcher exports arrives.
fn fake_ssh(dir: &std::path::Path) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let p = dir.join("fake_ssh");
    std::fs::write(&p, "#!/bin/sh\nshift\nexec env -i PATH=\"$PATH\" sh -c \"$1\"\n").expect("write fake ssh");
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    p
}

fn hostfile_launch(dir: &std::path::Path, script: &str, extra: &[&str]) -> std::process::Output {
    let hosts = dir.join("hosts");
    std::fs::write(&hosts, "127.0.0.1 slots=2\nlocalhost slots=2\n").expect("write hostfile");
    let port = free_port();
    std::process::Command::new(EXE)
        .args(["launch", "--hostfile"])
        .arg(&hosts)
        .arg("--ssh")
        .arg(fake_ssh(dir))
        .arg(format!("--master-port={port}"))
        .args(extra)
        .args(["--worker-program=/bin/sh", "--", "-c", script])
        .env("VITSCALE_TEST_MARK", "forwarded")
        .env("UNRELATED_VAR", "not forwarded")
        .env("HOME", dir)
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run vitscale launch")
}

#[test]
fn a_hostfile_fans_out_one_launcher_per_host() {
    let dir = tmp();
    let d = dir.path().display().to_string();
    std::fs::write(dir.path().join(".vitscale_env"), "# from the home directory\nFROM_ENV_FILE=yes\n").expect("write env file");
    let script = format!(
        "echo \"$RANK $WORLD_SIZE $LOCAL_RANK $GROUP_RANK $MASTER_ADDR $CUDA_VISIBLE_DEVICES $VITSCALE_TEST_MARK $FROM_ENV_FILE ${{UNRELATED_VAR:-unset}}\" > '{d}'/r$RANK"
    );
    // Slot 0 of the second host is excluded: ranks 0, 1 on host 0 and rank 2 on host 1 slot 1.
    let out = hostfile_launch(dir.path(), &script, &["--exclude=localhost:0"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let read = |r: usize| std::fs::read_to_string(dir.path().join(format!("r{r}"))).unwrap_or_default();
    // VITSCALE_* and .vitscale_env travel; other variables do not.
    assert_eq!(read(0).trim(), "0 3 0 0 127.0.0.1 0,1 forwarded yes unset");
    assert_eq!(read(1).trim(), "1 3 1 0 127.0.0.1 0,1 forwarded yes unset");
    assert_eq!(read(2).trim(), "2 3 0 1 127.0.0.1 1 forwarded yes unset");
}

#[test]
fn a_failing_rank_on_another_host_fails_the_launch() {
    let dir = tmp();
    let t0 = Instant::now();
    let out = hostfile_launch(dir.path(), "if [ \"$RANK\" = 3 ]; then exit 5; fi; sleep 30", &[]);
    // The other ranks sleep 30 s unless stopped. Starting two launchers through the stand-in
    // ssh and four shells takes about a second; 20 s leaves a loaded machine room and still
    // tells "stopped" from "waited out".
    assert!(t0.elapsed() < Duration::from_secs(20), "took {:?}", t0.elapsed());
    assert_eq!(out.status.code(), Some(5));
    let err = String::from_utf8_lossy(&out.stderr);
    // The remote launcher names the rank; ours names the node and host.
    assert!(err.contains("rank 3") && err.contains("exit status 5"), "{err}");
    assert!(err.contains("node 1 (localhost)"), "{err}");
}

fn one_gpu_launch(script: &str) -> std::process::Output {
    std::process::Command::new(EXE)
        .args(["launch", "--one-gpu", "--nproc-per-node", "3", "--worker-program=/bin/sh", "--", "-c", script])
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run vitscale launch")
}

/// Under `--one-gpu` rank r+1 starts only after rank r has signalled that its device is open
/// (the file named by VITSCALE_DEVICE_READY): each rank records when it started and when it
/// signalled, and every start comes after the previous rank's signal.
#[test]
fn one_gpu_ranks_start_in_turn_once_the_previous_device_is_open() {
    let dir = tmp();
    let d = dir.path().display().to_string();
    let script = format!("date +%s%N > '{d}'/start$RANK; sleep 0.3; date +%s%N > '{d}'/ready$RANK; : > \"$VITSCALE_DEVICE_READY\"; sleep 0.2");
    let out = one_gpu_launch(&script);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let ns = |name: String| -> u128 { std::fs::read_to_string(dir.path().join(&name)).unwrap_or_else(|e| panic!("{name}: {e}")).trim().parse().expect("nanoseconds") };
    for r in 1..3 {
        let (ready, start) = (ns(format!("ready{}", r - 1)), ns(format!("start{r}")));
        assert!(start >= ready, "rank {r} started {} ms before rank {} had its device", (ready - start) / 1_000_000, r - 1);
    }
}

/// A rank that exits before signalling does not hold the others back: the launch ends at once
/// with that rank's failure.
#[test]
fn a_one_gpu_rank_that_dies_before_its_device_does_not_stall_the_launch() {
    let t0 = Instant::now();
    let out = one_gpu_launch("[ \"$RANK\" = 0 ] && exit 3; : > \"$VITSCALE_DEVICE_READY\"; sleep 0.1");
    assert!(!out.status.success());
    assert!(t0.elapsed() < std::time::Duration::from_secs(30), "took {:?}", t0.elapsed());
    assert!(String::from_utf8_lossy(&out.stderr).contains("rank 0"), "{}", String::from_utf8_lossy(&out.stderr));
}

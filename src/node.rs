//! `ambit node`: the agent and the shared proxy for one host, as two child
//! processes of one parent. Each is restarted if it exits, so one can crash
//! or be upgraded while the other keeps the pods' traffic flowing; SIGTERM or
//! SIGINT stops both. Both roles read their configuration from the
//! environment (`ambit agent --help`, `ambit proxy --help`).

use std::time::{Duration, Instant};

use tokio::process::{Child, Command};
use tokio::signal::unix::{signal, SignalKind};

fn spawn(role: &str) -> std::io::Result<Child> {
    Command::new(std::env::current_exe()?)
        .arg(role)
        .kill_on_drop(true)
        .spawn()
}

pub fn run(args: &[String]) -> anyhow::Result<()> {
    if matches!(args, [a] if a == "--help" || a == "-h") {
        println!("ambit node: runs `ambit agent` and `ambit proxy` for this host as child processes,\nrestarting either if it exits; SIGTERM or SIGINT stops both.\nBoth read their configuration from the environment: see `ambit agent --help`\nand `ambit proxy --help`.");
        return Ok(());
    }
    if let Some(a) = args.first() {
        anyhow::bail!("ambit node takes no arguments (got {a:?}); configure the agent and proxy through the environment");
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(supervise())
}

/// How long the children have to exit once told to.
const EXIT_DEADLINE: Duration = Duration::from_secs(25);

async fn supervise() -> anyhow::Result<()> {
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut agent = (spawn("agent")?, Instant::now());
    let mut proxy = (spawn("proxy")?, Instant::now());
    loop {
        tokio::select! {
            _ = term.recv() => break,
            _ = int.recv() => break,
            status = agent.0.wait() => agent = restart("agent", status, agent.1).await?,
            status = proxy.0.wait() => proxy = restart("proxy", status, proxy.1).await?,
        }
    }
    for child in [&mut agent.0, &mut proxy.0] {
        if let Some(pid) = child.id() {
            // SAFETY: kill(2) on our own, not yet reaped, child.
            unsafe {
                libc::kill(pid as libc::pid_t, libc::SIGTERM);
            }
        }
    }
    // Both exit side by side within one deadline, then are killed (on
    // drop). It is the agent's worst case, a wedged API server (6 s for a
    // reconcile pass, then up to three 5 s requests), with room to spare,
    // and inside the kubelet's default 30 s grace.
    let (a, p) = (&mut agent.0, &mut proxy.0);
    let _ = tokio::time::timeout(EXIT_DEADLINE, async { tokio::join!(a.wait(), p.wait()) }).await;
    Ok(())
}

async fn restart(
    role: &str,
    status: std::io::Result<std::process::ExitStatus>,
    started: Instant,
) -> anyhow::Result<(Child, Instant)> {
    eprintln!("ambit node: {role} exited ({status:?}); restarting");
    // Crash loops back off to one restart per second.
    if let Some(rest) = Duration::from_secs(1).checked_sub(started.elapsed()) {
        tokio::time::sleep(rest).await;
    }
    Ok((spawn(role)?, Instant::now()))
}

pub fn run(_args: &[String]) -> anyhow::Result<()> {
    anyhow::bail!("demo: coming")
}

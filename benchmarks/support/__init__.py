"""What benchmarks and tests share and services never load: a loopback WAN link emulator,
fixed synthetic trajectories, and a private dockerd."""

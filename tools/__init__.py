"""Tools beside the benchmark harness, each run as `python -m tools.NAME --help`: where device time goes
(kernel_breakdown, train_step_breakdown), what ptxas made of the Hopper kernels (hopper_resources), tile tuning
(tune), and jaxpr snapshots to check a refactor byte for byte (jaxpr_snapshot)."""

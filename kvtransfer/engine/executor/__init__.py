"""How the scheduler reaches its workers: one process per (pp_rank, tp_rank), a typed pipe
protocol between them, and the errors a dead or misbehaving worker turns into."""

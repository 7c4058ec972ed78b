"""Choosing a configuration by compiling it (internal; public as
`zerojax.plan` and `plan_offload`): the offload planner (`planner`), the
candidates' cost (`costmodel`, read from the HLO by `hlo`), and
`stage="auto"` (`autoconfig`). The step imports this package only inside
the functions that plan at its first call (tests/test_imports.py)."""

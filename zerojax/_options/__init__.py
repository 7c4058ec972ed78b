"""The configuration (internal; the public names are `zerojax.ZeroConfig` and
the groups): the options a user writes (`groups`), the validated
`ZeroConfig` with its flat fields (`config`), and what a configured stage
does (`policy`). Imports nothing of zerojax but `zerojax.deepspeed`."""

"""The driver and what it drives: `[run]` / `[train]` sections (`config`), the job every
worker is given (`job`), the strategy protocol (`protocol`), what training minimises
(`objective`), a replica's checkpoint format (`state`), and the one driver (`driver`)."""

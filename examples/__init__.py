"""Users' own models trained by scaleout: run the scripts, or name their factories in TOML."""

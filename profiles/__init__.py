"""Data: device profiles, model profiles and reference results (TOML)."""

"""Data of the estimators: calibration constants, transformer measurements and the
recognition corpus; ``make_attention_data.py`` (run in a separate venv with torch and
transformers) regenerates the measurements and the corpus. Never imported at estimate
time."""

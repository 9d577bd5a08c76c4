"""The test suite: `unit` runs in this process alone, `integration` starts Ray, subprocesses
or process groups; the helper modules beside them are imported as `tests.<module>`."""

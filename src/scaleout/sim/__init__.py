"""Calibrated simulation: `scaleout calibrate` measures this machine, `scaleout simulate`
runs each strategy's schedule as a discrete-event simulation priced by those measurements."""

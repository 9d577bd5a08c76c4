"""The papers' figures that more than one suite puts its results beside, written once."""

# Ding et al. 2015, table 1 (Titan Black GPUs): seconds per 20 iterations of AlexNet at batch
# 256 (128 per GPU on 2), by (GPUs, parallel loading); the suites `sync`, `gpu` and
# `sim_papers` quote it. Which column of the table it is, the text extraction does not settle:
# `sync` reads it as cuDNN-R2, the Titan hardware file (`configs/hardware/ding_titan.json`)
# as cuda-convnet.
DING_TABLE_1 = {(1, True): 32.76, (1, False): 43.52, (2, True): 23.39, (2, False): 28.92}

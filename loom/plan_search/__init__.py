"""`loom plan --search`: which layout to run a job with on N GPUs — enumerated (search.py), priced by a cost model
(cost.py) from calibrated machine facts (calibration.py, calibrate.py) and the job's sizes and data (workload.py),
reported and written as a config (report.py)."""

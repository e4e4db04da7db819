"""The GPU device check: prepare.sh here, run.sh on the device machine, check.py its body."""

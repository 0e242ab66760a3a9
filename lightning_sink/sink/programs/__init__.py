"""The programs a sink runs: the eager pair (``eager.py``) and the compiled whole-step programs (``compiled.py``)."""

"""Sink mode: K micro-batches inside one Lightning batch. The loop (``loop.py``) plans segments between schedule
points (``schedule.py``, ``step_triggers.py``), buffers ``self.log`` inside a sink (``logging.py``), reads the
training set staged on the device (``staging.py``) and runs the sink's programs (``programs/``)."""

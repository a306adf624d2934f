"""The run store and what reads it: the parquet store (``store``), the trainer exports
(``export``), the evaluation report (``report``) and a run's capacity numbers (``capacity``)."""

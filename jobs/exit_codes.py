"""The `ditfleet` command's exit codes (the meanings: jobs/cli.py's docstring).

0: done. 1: the job ran but rows or shards failed, or it stopped on a store error after retries
(run it again to resume). 2: bad job file, input, location, store or usage: nothing written."""

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2

"""The output as the driver sees it: claiming it for a job (claim, job_file), fencing stragglers and
finishing a run (fence, finish, summary), and reading it back (status, verify, json_objects)."""

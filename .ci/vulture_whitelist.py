"""Names vulture (`make deadcode`, confidence 80) reports that are used, each with why.

Vulture reads this file as code that uses the names below. Add a name only after checking that
it is really used (by Python itself, a framework or a caller vulture cannot see), with a comment
that says which; remove it when the code it covers goes.
"""

# The `*exc` of a context manager's `__exit__(self, *exc)`: Python passes the exception there;
# these `__exit__` methods release or close whatever happened, so they do not read it.
exc  # noqa: B018, F821  (driver/output/lease.py OutputLease, workers/output/upload_pool.py UploadPool)

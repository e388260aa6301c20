"""Prints its arguments as one JSON line ("ARGV [...]"): what the launcher handed the script."""
import json
import sys

print("ARGV " + json.dumps(sys.argv[1:]), flush=True)

"""Tool use: running the code a policy writes in a sandbox."""

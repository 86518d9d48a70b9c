"""Tool use: the policy writes Python code, a sandbox runs it, and its output joins the conversation."""

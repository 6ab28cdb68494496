"""The experiment harness: experiment files to points (`plan`), one point run to its result (`runner`)."""

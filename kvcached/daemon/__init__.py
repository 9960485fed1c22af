"""The daemon: a supervisor process and one worker process per rank."""

"""One thin module per DVC stage and per command: load params, call the library, publish outputs, record the run."""

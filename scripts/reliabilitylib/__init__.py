"""The parts of scripts/reliability.py: the server under test and its probes (`target`),
streamed completions judged against a reference (`streams`), the load, storm and overload phases
(`phases`), the fuzz cases and phase (`cases`, `fuzz`), the report tables (`report`) and the
command line (`cli`). HTTP goes through benchlib.client; nothing here loads a model."""

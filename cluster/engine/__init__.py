"""One replica's engine: the step loop, scheduler, caches, requests and detokenizer. No Ray, no HTTP."""

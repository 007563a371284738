"""Scaling out: engine replicas on Ray Serve behind one OpenAI endpoint (`engine-serve
--replicas N`), with prefix-aware routing. Needs the `ray` extra; nothing here is imported
by the single-process server."""

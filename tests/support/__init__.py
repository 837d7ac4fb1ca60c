"""Test support: what the tests start, write and measure. Nothing here is a test; no test imports another.

- ports: the free-port helper and the wait until a port listens.
- servers: the in-process weightstream server on port 0 (serving, running with its REST endpoint).
- serve_processes: `weightstream serve` as its own process (serve_process, Supervisor that restarts it).
- commands: the `weightstream` command run as a process (executable, clean environment, result).
- s3_stores: the S3-protocol servers (s3rver, moto) and settings that point a server at one.
- checkpoints: the checkpoints the tests write, and byte comparisons of what was read back.
- certificates: a CA with server and client certificates for the TLS tests.
- metrics: a server's Prometheus samples and its process's resident memory.
- faults: a TCP proxy that cuts or freezes connections.
- reliability_report: the pytest plugin that prints the figures the reliability tests record.
- vllm_runs: the vLLM test's model and engine runs in .venv-vllm; vllm_scripts/ holds the scripts
  that run there (by path, with that environment's interpreter).
- sglang_runs: the SGLang tests' model, engine sessions in .venv-sglang and launch_server;
  sglang_scripts/ holds the session script that runs there.
"""

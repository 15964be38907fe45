"""kvtransfer connectors hosted by other engines (`vllm`); each module imports its engine."""

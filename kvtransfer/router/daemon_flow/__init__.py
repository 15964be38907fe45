"""The P/D flow on kvtransfer daemons, over gRPC: a choice from its prefill to its decode's last
token (`choice.ChoiceRunner`, life cycle docstring), the gRPC calls and their typed failures
(`upstream`), and the parts a choice is run with: its state and token stream (`exchange`), the
instances leased for it (`leases`), its decode call (`decode_leg`), KV released when nobody
decodes it (`releases`) and its last delta, metrics and trace (`report`)."""

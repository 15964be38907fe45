"""The OpenAI API as the router speaks it, below everything that routes: requests parsed and
checked into choices (`requests`), answers written in the completions and chat shapes
(`responses`), and a prompt's token ids as the daemons compute them (`tokens`, which loads a
tokenizer: imported only when the router is given one)."""

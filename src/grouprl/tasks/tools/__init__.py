"""What a policy calls while it writes: tools and the tags call format (`calls`), the chat
format of a model's template (`chat`), the tools' description to the model (`prompt`),
stateful environments (`environments`), a run's tool use (`use`), and conversations with tool
calls as `grouprl sft --data` trains on them (`conversations`)."""

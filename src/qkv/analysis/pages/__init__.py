"""Pages a person opens: the attention viewer (`qkv viz`) and the offline HTML report
(`qkv report`)."""

"""The `qkv` sub-commands, one module each: `add_parser(commands)` registers it, and its `run`
function parses nothing itself, calls one library function and prints."""

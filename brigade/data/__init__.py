"""What a run reads: text and its tokens, and the order it reads them in.

- `text`: a UTF-8 file or the built-in corpus, and the windows of ids cut from it;
- `chars`: the built-in GPT's characters (`Vocab`, `load_text_data`);
- `tokenizer`: a model directory's tokenizer, its end-of-sequence token and its hash;
- `corpus`: the documents of a corpus (text files, folders, JSON Lines, Parquet, a `datasets`
  folder), read a piece at a time; `instruct`: chat and prompt/completion examples;
- `shards` and `tokenize`: `brigade tokenize` writes token shards and their manifest once;
  every rank memory-maps them and reads only its own windows (`shards.TokenWindows`);
- `prepared`: what `--data` becomes for a tokenized model, a shard folder or a file tokenized
  into a cache beside the run;
- `sampler`: the order of the examples, one global cursor that means the same thing under any
  layout, so a run resumes on another dp, pp, tp or node count with the same samples.

Nothing here knows of models or of parallelism.
"""

#!/bin/bash
# The rounds of README.md, in order (the code changed between them: see README.md). Run from this folder with REPO
# and SNAP set (quick3.sh). Each round: a fresh server per method, levels 16,16,32,32, 64 GSM8K requests a level.
for r in 1 2; do  # commit 12ddb3e
  ./quick3.sh plain 8700 none 16,16,32,32 64 gsm8k $r
  ./quick3.sh entmtp 8701 '{"method":"entmtp"}' 16,16,32,32 64 gsm8k $r
done
# r3: the draft_time variant (not committed), entmtp first
./quick3.sh entmtp 8701 '{"method":"entmtp"}' 16,16,32,32 64 gsm8k 3
./quick3.sh plain 8700 none 16,16,32,32 64 gsm8k 3
for r in 4 5; do  # EXPLORE_UNMEASURED_EVERY = 8
  ./quick3.sh plain 8700 none 16,16,32,32 64 gsm8k $r
  ./quick3.sh entmtp 8701 '{"method":"entmtp"}' 16,16,32,32 64 gsm8k $r
done

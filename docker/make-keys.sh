#!/bin/sh
# Generate the CURVE key pairs that docker-compose.yml mounts as secrets, one pair per role:
#   broker    the broker's server key (engines and consumers pin broker.key)
#   consumer  the consumers' key: client key towards the broker, server key of their trainer endpoint
#   engine    the engines' client key (the broker allows engine.key)
#   trainer   the trainers' client key (the consumers allow trainer.key)
# Writes DIR/NAME.key (public) and DIR/NAME.key_secret; keeps pairs that already exist (delete one to rotate it).
#   sh docker/make-keys.sh ./keys                                   # with routing-replay installed here
#   docker compose --profile setup run --rm keys                    # or inside the image
set -eu
dir=${1:?usage: make-keys.sh DIR}
mkdir -p "$dir"
# keep secret keys out of git when DIR lies inside a checkout
[ -e "$dir/.gitignore" ] || printf '*\n' > "$dir/.gitignore"
for name in broker consumer engine trainer; do
    if [ -e "$dir/$name.key_secret" ]; then
        echo "keep $dir/$name.key_secret"
    else
        routing-replay keys "$dir" --name "$name"
    fi
done

//! Request parser: every input is parsed as all three OpenAI bodies (completions, chat,
//! responses), with the default limits and a tight depth limit. Checks that parsing never
//! panics, is deterministic, honours the limits, reads every body as the tree walk does
//! (the one-pass readers of chat and completions bodies included), and that an accepted
//! prompt hashes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tokenaware::prefix::{chain_seed, hash_prompt};
use tokenaware::request::{
    parse, parse_tree, ApiKind, ParseError, ParseLimits, TREE_FALLBACK_BYTES,
};

const KINDS: [ApiKind; 3] = [
    ApiKind::Completions,
    ApiKind::ChatCompletions,
    ApiKind::Responses,
];

fuzz_target!(|body: &[u8]| {
    let tight = ParseLimits {
        max_body_bytes: 4096,
        max_depth: 4,
    };
    // The least depth limit the one-pass readers still take (below it the tree walk alone
    // reads): where they count depth themselves, a small body reaches the limit.
    let shallow = ParseLimits {
        max_depth: 8,
        ..ParseLimits::default()
    };
    for kind in KINDS {
        let got = parse(kind, body, &ParseLimits::default());
        assert_eq!(got, parse(kind, body, &ParseLimits::default()));
        if body.len() <= TREE_FALLBACK_BYTES {
            // Errors included: what the one-pass readers refuse, the tree walk reads and names.
            assert_eq!(got, parse_tree(kind, body, &ParseLimits::default()));
            assert_eq!(
                parse(kind, body, &shallow),
                parse_tree(kind, body, &shallow)
            );
        }
        let small = parse(kind, body, &tight);
        if body.len() > tight.max_body_bytes {
            assert_eq!(small, Err(ParseError::TooLarge));
        } else if small.is_ok() {
            // Tighter limits never accept what the defaults reject.
            assert_eq!(small, got);
        }
        if let Ok(req) = got {
            assert!(!req.model.is_empty());
            if let Some(n) = req.prompt_token_ids {
                assert_eq!(req.prompt.len() as u64, 4 * n);
            }
            let seed = chain_seed(&req.model, req.cache_salt.as_deref());
            let chain = hash_prompt(seed, &req.prompt, 64, 256);
            assert_eq!(chain.len(), req.prompt.len().div_ceil(64).min(256));
        }
    }
});
